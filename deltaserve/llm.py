"""LLM: the offline API, shaped like vLLM's `LLM(model=...).generate(prompts, sampling_params)`."""

from __future__ import annotations

import dataclasses

from tqdm import tqdm

from deltaserve.config import EngineConfig
from deltaserve.engine.llm_engine import LLMEngine, freeze_startup_objects
from deltaserve.generation_defaults import sampling_defaults
from deltaserve.outputs import RequestOutput
from deltaserve.sampling import RequestOutputKind, SamplingParams


class LLM:
    def __new__(cls, *args, **kwargs):
        freeze_startup_objects()  # as LLMEngine does: this object stays collectable
        return super().__new__(cls)

    def __init__(self, model: str | None = None, **engine_args):
        known = {f.name for f in dataclasses.fields(EngineConfig)}
        unknown = sorted(set(engine_args) - known)
        if unknown:
            raise TypeError(f"unknown engine argument(s) {unknown}; known: {sorted(known)}")
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args))
        self._counter = 0
        config = self.engine.config
        self._defaults = sampling_defaults(self.engine.model_path, config.generation_config,
                                           config.override_generation_config)

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams from the checkpoint's generation_config.json (as vLLM); used when none are given."""
        return SamplingParams(**self._defaults)

    def get_tokenizer(self):
        return self.engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (as vLLM's LLM.reset_prefix_cache); False while requests run."""
        return self.engine.reset_prefix_cache()

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for a prompt or a list of prompts (text, token-id lists, or {"prompt_token_ids": [...]}).

        Returns one RequestOutput per prompt, in the order given.
        """
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling params for {len(prompts)} prompts")
        ids = []
        group = f"generate-{self._counter}"  # one call, one client: admitted in order, as a batch
        for prompt, params in zip(prompts, sampling_params):
            # only the finished outputs are returned: none is built before (O(length) a step each, cumulative)
            params = dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
            if isinstance(prompt, dict):
                prompt = prompt.get("prompt_token_ids", prompt.get("prompt"))
            request_id = str(self._counter)
            self._counter += 1
            self.engine.add_request(request_id, prompt, params, group=group)
            ids.append(request_id)
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished():
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
        return [finished[i] for i in ids]
