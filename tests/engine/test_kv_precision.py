"""Cache precision: what an fp8 KV cache and a bf16 recurrent state cost in accuracy, on the tiny checkpoints.

Teacher-forced: every variant reads the same random token sequences and we compare its next-token
distribution at every position with the float32 reference (float32 model, float32 KV, float32 state):
top-1 agreement and KL(reference || variant) in nats. The KV variants run as chunked prefill (every key and
value is read back from the cache, so the rounding of each one counts); the state variants decode token by
token, because the state is rounded to its cache dtype at every step. The assertions are loose bounds well
above the measured values; `python -m tests.engine.test_kv_precision` prints the table in docs/memory.md.
"""

import logging

import pytest
import torch

from deltaserve import LLM, SamplingParams
from deltaserve.config import ModelConfig
from deltaserve.layers.batch import ForwardBatch
from deltaserve.model.loader import load_model
from deltaserve.ops.attention.reference import paged_attention, write_kv_cache
from deltaserve.worker.kv_cache import CacheShape, bind_caches
from tests.tolerance import assert_within, attention_bound, both_sides, unit_roundoff

ARCHS = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
BLOCK_SIZE = 16
FP8 = torch.float8_e4m3fn
# variant: (KV dtype, recurrent-state dtype, decode token by token)
VARIANTS = {
    "bf16 KV": (torch.bfloat16, torch.float32, False),
    "fp8 KV": (FP8, torch.float32, False),
    "bf16 state": (torch.float32, torch.bfloat16, True),
    "fp8 KV + bf16 state": (FP8, torch.bfloat16, True),
}
PREFILL = dict(num_seqs=2, length=1536, chunk=512)  # 3,072 positions, prefilled in three chunks
DECODE = dict(num_seqs=4, length=320, prompt=64)  # 1,280 positions, 1,024 of them decoded one by one


def teacher_forced_logits(model, tokens: torch.Tensor, kv_dtype, ssm_dtype, chunks: list[int]) -> torch.Tensor:
    """tokens: [N, L]; each step feeds the next `chunks[i]` tokens of every sequence. Returns [N, L, V]."""
    num_seqs, length = tokens.shape
    per_seq = -(-length // BLOCK_SIZE)
    bind_caches(model, CacheShape(num_seqs * per_seq + 1, BLOCK_SIZE, num_seqs + 1, kv_dtype, ssm_dtype), "cpu")
    blocks = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(num_seqs)]
    slots = list(range(1, num_seqs + 1))
    logits, done = [], 0
    with torch.inference_mode():
        for chunk in chunks:
            batch = ForwardBatch.build([done] * num_seqs, [chunk] * num_seqs, blocks, slots, BLOCK_SIZE)
            hidden = model(tokens[:, done:done + chunk].reshape(-1), batch)  # [N * chunk, H]
            logits.append(model.compute_logits(hidden).view(num_seqs, chunk, -1))
            done += chunk
    return torch.cat(logits, dim=1)


def agreement(reference: torch.Tensor, variant: torch.Tensor) -> tuple[float, float, float]:
    """(top-1 agreement, mean KL, max KL) of variant against reference logits, both [..., V]."""
    log_p, log_q = reference.log_softmax(-1), variant.log_softmax(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    top1 = (reference.argmax(-1) == variant.argmax(-1)).float().mean().item()
    return top1, kl.mean().item(), kl.max().item()


def measure(path) -> dict[str, tuple[float, float, float]]:
    """Every variant of VARIANTS against the float32 reference on the checkpoint at `path`."""
    torch.manual_seed(0)
    cfg = ModelConfig.from_pretrained(path)
    model = load_model(path, cfg, torch.float32, "cpu")
    runs = {
        False: (torch.randint(0, cfg.vocab_size, (PREFILL["num_seqs"], PREFILL["length"])),
                [PREFILL["chunk"]] * (PREFILL["length"] // PREFILL["chunk"])),
        True: (torch.randint(0, cfg.vocab_size, (DECODE["num_seqs"], DECODE["length"])),
               [DECODE["prompt"]] + [1] * (DECODE["length"] - DECODE["prompt"])),
    }
    reference = {decode: teacher_forced_logits(model, tokens, torch.float32, torch.float32, chunks)
                 for decode, (tokens, chunks) in runs.items()}
    results = {}
    for name, (kv_dtype, ssm_dtype, decode) in VARIANTS.items():
        tokens, chunks = runs[decode]
        results[name] = agreement(reference[decode], teacher_forced_logits(model, tokens, kv_dtype, ssm_dtype, chunks))
    return results


@pytest.fixture(scope="module", params=ARCHS)
def measured(request, make_checkpoint):
    # Thousands of forwards on tensors of a few KiB: a second thread only adds synchronisation, which costs
    # seconds per test on a busy machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return request.param, measure(make_checkpoint(request.param))
    finally:
        torch.set_num_threads(threads)


# Loose bounds, several times the measured values (docs/memory.md): (min top-1 agreement, max mean KL, max KL).
# The tiny MoE routers have near-tied experts: a small perturbation can flip one, hence the large max KL.
# A bf16 state is rounded at every decoded token, so its bounds are wider.
BOUNDS = {"bf16 KV": (0.99, 1e-3, 1.0), "fp8 KV": (0.98, 2e-3, 1.0), "bf16 state": (0.95, 2e-2, 3.0),
          "fp8 KV + bf16 state": (0.95, 2e-2, 3.0)}


def test_fp8_kv_and_bf16_state_stay_close_to_float32(measured):
    arch, results = measured
    for name, (top1, mean_kl, max_kl) in results.items():
        min_top1, bound_mean, bound_max = BOUNDS[name]
        assert top1 >= min_top1, f"{arch} {name}: top-1 agreement {top1:.4f}"
        assert mean_kl <= bound_mean and max_kl <= bound_max, f"{arch} {name}: KL {mean_kl:.2e} / {max_kl:.2e}"
    # fp8 really quantizes: measurably further off than bf16
    assert results["bf16 KV"][1] < results["fp8 KV"][1]


def test_fp8_cache_stores_x_over_scale_and_reads_back_x_times_scale():
    torch.manual_seed(0)
    k = torch.randn(6, 2, 8) * 3.0  # [T, n_kv, hd]
    v = torch.randn(6, 2, 8)
    k_cache = torch.zeros(3, 4, 2, 8, dtype=FP8)  # [blocks, block_size, n_kv, hd]
    v_cache = torch.zeros_like(k_cache)
    slots = torch.arange(4, 10)  # blocks 1 and 2
    write_kv_cache(k, v, k_cache, v_cache, slots, k_scale=0.5, v_scale=0.25)
    stored_k = k_cache.view(-1, 2, 8)[slots].float()
    assert torch.equal(stored_k, (k / 0.5).to(FP8).float())
    # e4m3 keeps 3 mantissa bits: after the round trip every value is within u = 1/16 relative, or half the
    # subnormal spacing 2^-9 (times the scale) below the smallest normal 2^-6
    assert_within(stored_k * 0.5, k, unit_roundoff(FP8) * k.abs() + 0.5 * 2.0**-9 * 0.5, "fp8 round trip")
    # attention reads back cache * scale: equal to attention over the dequantized values in float32
    q = torch.randn(2, 4, 8)
    args = (torch.tensor([[1, 2]], dtype=torch.int32), torch.tensor([0, 2]), torch.tensor([6]), 8 ** -0.5)
    out = paged_attention(q, k_cache, v_cache, *args, k_scale=0.5, v_scale=0.25)
    expected = paged_attention(q, k_cache.float() * 0.5, v_cache.float() * 0.25, *args)
    held_k, held_v = (k_cache.float() * 0.5)[1:], (v_cache.float() * 0.25)[1:]  # blocks 1 and 2
    one_side = attention_bound(q, held_k, held_v, 8 ** -0.5, 6, torch.float32)
    assert_within(out, expected, both_sides(one_side, one_side), "fp8 attention")
    # values beyond the fp8 range saturate at +-448 instead of turning into NaN
    write_kv_cache(torch.full((1, 2, 8), 1e6), v[:1], k_cache, v_cache, torch.tensor([0]), k_scale=1.0)
    assert k_cache[0, 0].float().max().item() == 448.0
    with pytest.raises(ValueError, match="k_scale must be a positive finite number, got 0.0"):
        write_kv_cache(k, v, k_cache, v_cache, slots, k_scale=0.0)


def test_engine_runs_with_fp8_kv_and_bf16_state(make_checkpoint, caplog):
    path = str(make_checkpoint("qwen3_5"))
    with caplog.at_level(logging.INFO):
        llm = LLM(path, max_num_seqs=4, kv_cache_dtype="fp8", mamba_ssm_cache_dtype="bfloat16")
    model = llm.engine.runner.model
    assert model.attention_layers[0].k_cache.dtype == FP8
    assert model.gdn_layers[0].ssm_state.dtype == torch.bfloat16
    assert model.gdn_layers[0].conv_state.dtype == torch.float32  # the conv state keeps the model dtype
    assert "fp8 KV cache with per-tensor scales k_scale = v_scale = 1.0" in caplog.text
    assert "Memory plan for" in caplog.text and "(float8_e4m3fn)" in caplog.text
    out = llm.generate([[5, 6, 7, 8] * 10], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8


def _print_table() -> None:
    """The table of docs/memory.md, measured on freshly built tiny checkpoints."""
    import tempfile

    from deltaserve.demo import build_checkpoint

    torch.set_num_threads(1)  # tiny tensors: see the `measured` fixture
    print("| checkpoint | variant | top-1 agreement | mean KL (nats) | max KL (nats) |")
    print("|---|---|---|---|---|")
    for arch in ARCHS:
        with tempfile.TemporaryDirectory() as folder:
            for name, (top1, mean_kl, max_kl) in measure(build_checkpoint(folder, arch)).items():
                print(f"| {arch} | {name} | {top1:.4f} | {mean_kl:.2e} | {max_kl:.2e} |")


if __name__ == "__main__":
    _print_table()
