"""The engine on the GPU (bf16) against the CPU float32 reference, and CUDA graphs against eager.

Run on an H200 by tests/gpu/run.sh. Tolerances, measured there and recorded in docs/performance.md:
teacher-forced top-1 agreement of bf16 GPU logits with float32 CPU logits >= 0.95 and the mean |diff| of
logits <= 5% of their scale (bf16 carries ~3 significant digits through 6 layers); graphs == eager exactly.
"""

import pytest
import torch

from deltaserve import LLM, SamplingParams
from deltaserve.config import ModelConfig
from deltaserve.layers.batch import ForwardBatch
from deltaserve.model.loader import load_model
from deltaserve.worker.kv_cache import CacheShape, bind_caches

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

ARCHS = ["qwen3_5", "qwen3_5_moe", "qwen3_next"]


def prompt(n: int, seed: int, vocab: int = 1024) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def chunked_logits(path, dtype, device, ids: list[int], chunks: list[int]) -> torch.Tensor:
    """Logits of every position, the prompt fed in `chunks` then one token at a time."""
    cfg = ModelConfig.from_pretrained(path)
    model = load_model(path, cfg, dtype, device)
    bind_caches(model, CacheShape(64, 16, 4, dtype, torch.float32), device)
    out, done = [], 0
    sizes = chunks + [1] * (len(ids) - sum(chunks))
    for size in sizes:
        blocks = list(range(1, 1 + -(-(done + size) // 16)))
        batch = ForwardBatch.build([done], [size], [blocks], [1], 16, device)
        with torch.inference_mode():
            hidden = model(torch.tensor(ids[done:done + size], device=device), batch)
            out.append(model.compute_logits(hidden).float().cpu())
        done += size
    return torch.cat(out)


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_gpu_model_tracks_cpu_float32(arch, make_checkpoint):
    path = make_checkpoint(arch)
    ids = prompt(300, 1)
    chunks = [1, 100, 137, 40]  # crosses GDN chunks (64) and KV blocks (16); then 22 decode steps
    ref = chunked_logits(path, torch.float32, "cpu", ids, chunks)
    gpu = chunked_logits(path, torch.bfloat16, "cuda", ids, chunks)
    agreement = (ref.argmax(-1) == gpu.argmax(-1)).float().mean().item()
    rel = ((ref - gpu).abs().mean() / ref.abs().mean()).item()
    print(f"{arch}: top-1 agreement {agreement:.4f}, mean |diff| / mean |logit| {rel:.4f}")
    assert agreement >= 0.95 and rel <= 0.05


@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_graphs_equal_eager_token_for_token(arch, make_checkpoint):
    path = str(make_checkpoint(arch))
    prompts = [prompt(n, 10 + n) for n in (5, 77, 1, 300, 33)]  # 5 sequences: padded to the size-8 graph
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    graphs = LLM(path, dtype="bfloat16", max_num_seqs=16, enforce_eager=False)
    eager = LLM(path, dtype="bfloat16", max_num_seqs=16, enforce_eager=True)
    assert graphs.engine.runner.graphs is not None and eager.engine.runner.graphs is None
    a = [o.outputs[0].token_ids for o in graphs.generate(prompts, params, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    assert a == b


def test_any_max_num_seqs_starts_and_serves(make_checkpoint):
    """Graph sizes follow max_num_seqs (here not a multiple of 8), and padding never touches real slots."""
    llm = LLM(str(make_checkpoint("qwen3_5")), dtype="bfloat16", max_num_seqs=13, enforce_eager=False)
    assert llm.engine.runner.graphs.sizes == [1, 2, 4, 8, 13]
    outs = llm.generate([prompt(9, s) for s in range(11)], SamplingParams(temperature=0, max_tokens=8),
                        use_tqdm=False)
    alone = llm.generate([prompt(9, 3)], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert outs[3].outputs[0].token_ids == alone[0].outputs[0].token_ids
