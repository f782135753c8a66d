"""ModelRunner: SchedulerOutput -> flattened tensors -> forward -> sample -> ModelOutput."""

from __future__ import annotations

import torch

from deltaserve.layers.batch import ForwardBatch
from deltaserve.model.qwen3_5 import HybridForCausalLM
from deltaserve.sampling import Sampler
from deltaserve.sched_output import ModelOutput, SchedulerOutput
from deltaserve.worker.kv_cache import CacheShape, bind_caches


class ModelRunner:
    def __init__(self, model: HybridForCausalLM, cache_shape: CacheShape, device: torch.device):
        self.model = model
        self.device = device
        self.block_size = cache_shape.block_size
        bind_caches(model, cache_shape, device)
        self.sampler = Sampler()

    @torch.inference_mode()
    def execute(self, scheduled: SchedulerOutput) -> ModelOutput:
        rows = scheduled.sequences
        batch = ForwardBatch.build(
            num_computed=[r.num_computed for r in rows],
            query_lens=[len(r.token_ids) for r in rows],
            block_ids=[r.block_ids for r in rows],
            state_slots=[r.state_slot for r in rows],
            block_size=self.block_size,
            device=self.device,
        )
        input_ids = torch.tensor([t for r in rows for t in r.token_ids], dtype=torch.int64, device=self.device)
        hidden = self.model(input_ids, batch)  # [T, H]
        sampling_rows = [i for i, r in enumerate(rows) if r.sample]
        if not sampling_rows:
            return ModelOutput({}, {}, {})
        last = batch.logits_indices[torch.tensor(sampling_rows, device=self.device)]
        logits = self.model.compute_logits(hidden[last])  # [S, V] float32
        chosen = [rows[i] for i in sampling_rows]
        out = self.sampler(
            logits,
            params=[r.params for r in chosen],
            generators=[r.generator for r in chosen],
            prompt_token_ids=[r.prompt_token_ids for r in chosen],
            output_token_ids=[r.output_token_ids for r in chosen],
            eos_token_ids=[r.eos_token_ids for r in chosen],
        )
        ids = [r.request_id for r in chosen]
        top = {rid: t for rid, t in zip(ids, out.top_logprobs) if t is not None}
        return ModelOutput(dict(zip(ids, out.token_ids)), dict(zip(ids, out.logprobs)), top)
