"""Programmatic dependent launch (ops/pdl.py) on the GPU: launches really overlap, the wait orders them, and the
engine's tokens do not change with it.

Run on an H200 by tests/gpu/run.sh (PDL needs compute capability 9.0; the tests skip below it).
"""

import pytest
import torch
import triton
import triton.language as tl

from deltaserve import LLM, SamplingParams
from deltaserve.ops import pdl
from deltaserve.ops.pdl import wait_for_previous_kernel

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                                reason="needs a CUDA device of compute capability 9.0 or later")


@triton.jit
def _slow_write(out, spins, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Let the next kernel launch at once (which our kernels do not: they let it launch when they exit), spin a
    while, then write 1.0 into out [grid * BLOCK]."""
    wait_for_previous_kernel(PDL)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for _ in range(spins):
        acc = acc * 0.5 + 0.5  # reaches 1.0 exactly after ~25 steps; the loop is the delay
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out + offs, acc)


@triton.jit
def _copy_after(src, dst, BLOCK: tl.constexpr, WAIT: tl.constexpr, PDL: tl.constexpr):
    """dst = src, after pdl's wait (WAIT) or without it (to show that the launches overlap)."""
    if WAIT:
        wait_for_previous_kernel(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst + offs, tl.load(src + offs))


def _write_then_copy(wait: bool, graph: bool) -> float:
    """The fraction of dst that saw the writer's 1.0s."""
    block, programs = 256, 64
    src = torch.zeros(programs * block, device="cuda")
    dst = torch.full_like(src, -1.0)
    launch = pdl.launch_args(src.device)

    def run():
        _slow_write[(programs,)](src, 200_000, BLOCK=block, **launch)
        _copy_after[(programs,)](src, dst, BLOCK=block, WAIT=wait, **launch)

    run()  # compiles both
    src.zero_()
    dst.fill_(-1.0)
    torch.cuda.synchronize()
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            run()
        src.zero_()
        dst.fill_(-1.0)
        g.replay()
    else:
        run()
    torch.cuda.synchronize()
    return (dst == 1.0).float().mean().item()


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_pdl_launches_overlap_and_the_wait_orders_them(graph):
    if not pdl.enabled(torch.device("cuda")):
        pytest.skip("DELTASERVE_PDL=0")
    assert _write_then_copy(wait=True, graph=graph) == 1.0
    # Without the wait the copy runs while the writer spins: proof that the launches really overlap (and so
    # that the engine tests below exercise the wait).
    assert _write_then_copy(wait=False, graph=graph) < 1.0


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_engine_tokens_equal_with_and_without_pdl(arch, make_checkpoint):
    """Greedy tokens of CUDA-graph decoding with every kernel of ours launched with PDL against plain launches."""
    if not pdl.enabled(torch.device("cuda")):
        pytest.skip("DELTASERVE_PDL=0")
    path = str(make_checkpoint(arch))
    prompts = [torch.randint(0, 1024, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (5, 77, 1, 300, 33, 2)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    tokens = {}
    try:
        for flag in (True, False):
            pdl.set_enabled(flag)
            llm = LLM(path, dtype="bfloat16", max_num_seqs=16)
            assert pdl.enabled(torch.device("cuda")) is flag  # the engine's start-up check passed
            tokens[flag] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            del llm
    finally:
        pdl.set_enabled(None)
    assert tokens[True] == tokens[False]
