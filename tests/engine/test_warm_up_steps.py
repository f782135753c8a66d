"""The start-up warm-up's engine steps (worker/warm_up.engine_steps, run on GPUs before serving) on the CPU: the
kinds of step they run, so that no served request meets a kernel variant they left uncompiled."""

import pytest

from deltaserve.config import EngineConfig
from deltaserve.engine.llm_engine import LLMEngine
from deltaserve.worker import warm_up


@pytest.mark.parametrize("max_model_len, max_num_batched_tokens", [(4096, 8192), (2000, 512)])
def test_prompt_steps_alone_meet_both_token_count_classes_triton_specializes_on(make_checkpoint, max_model_len,
                                                                               max_num_batched_tokens):
    """Triton compiles a kernel variant per class of each integer argument (== 1, divisible by 16, neither), and a
    step's token count is such an argument: among the warm-up's steps of prompt tokens alone, one has a multiple of
    16 tokens (a served 1,024-token prompt's class) and one has not, whatever --max-model-len cuts the long prompt
    to (4,088 tokens at 4,096, where the warm-up's other prompt-only steps had 4,088 and 12) and whatever chunks
    --max-num-batched-tokens cuts the prompts into."""
    engine = LLMEngine(EngineConfig(model=str(make_checkpoint("qwen3_5")), device="cpu", dtype="float32",
                                    max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens,
                                    skip_tokenizer_init=True))
    prompt_steps, step = [], engine.step

    def recorded_step():
        outputs = step()
        scheduled = engine.last_scheduled
        if scheduled.sequences and all(len(row.token_ids) > 1 for row in scheduled.sequences):  # prompt rows alone
            prompt_steps.append(scheduled.num_tokens)
        return outputs

    engine.step = recorded_step
    warm_up.engine_steps(engine)
    assert any(tokens % 16 == 0 for tokens in prompt_steps), prompt_steps
    assert any(tokens % 16 for tokens in prompt_steps), prompt_steps
    assert not engine.has_unfinished()


def test_decoding_requests_take_every_sampler_path(make_checkpoint, monkeypatch):
    """The warm-up's short requests decode through the sampler's paths beside the greedy argmax (temperature with
    top-k / top-p, the penalties, min_tokens' mask, the logprobs' top-k), so that a first sampled request (Qwen's
    generation defaults sample) meets no torch kernel for the first time."""
    from deltaserve.worker import sampler

    engine = LLMEngine(EngineConfig(model=str(make_checkpoint("qwen3_5")), device="cpu", dtype="float32",
                                    max_model_len=2000, max_num_batched_tokens=512, skip_tokenizer_init=True))
    ran = set()
    for name in ("_sample", "_top_k_top_p", "_unique_row_tokens"):  # random rows, their filters, the penalties
        original = getattr(sampler, name)
        monkeypatch.setattr(sampler, name, lambda *a, _name=name, _f=original, **k: ran.add(_name) or _f(*a, **k))
    pending = sampler.PendingSample

    def recorded(token_ids, logprobs, top, wanted):
        if top is not None:
            ran.add("top logprobs")
        return pending(token_ids, logprobs, top, wanted)

    monkeypatch.setattr(sampler, "PendingSample", recorded)
    warm_up.engine_steps(engine)
    assert ran == {"_sample", "_top_k_top_p", "_unique_row_tokens", "top logprobs"}
    assert not engine.has_unfinished()
