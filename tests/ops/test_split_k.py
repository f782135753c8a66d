"""Split-K products that finish their own sums (ops/split_k.py): the tile's last program adds the partials in split
order, and the counters are back at zero for the next launch (the Triton interpreter on the CPU in CI, the real
kernel on the GPU, where the programs arrive in any order)."""

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from deltaserve.ops import split_k  # noqa: E402
from tests.ops.interpreter import patch_interpreter_index  # noqa: E402

patch_interpreter_index()

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _splits_kernel(values, out, partial, counters, M, N, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """Grid (cdiv(N, BLOCK_N), splits): split s's partial of out [M, N] is values [s, M, N] (float32), stored and
    summed by store_split as the products do."""
    ns = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    ms = tl.arange(0, BLOCK_M)  # [BM]
    ok = (ns[:, None] < N) & (ms[None, :] < M)  # [BN, BM]
    tile = ms[None, :] * N + ns[:, None]
    acc = tl.load(values + tl.program_id(1) * M * N + tile, mask=ok, other=0.0)
    split_k.store_split(acc, out + tile, partial + tile, ok, M * N, counters, tl.program_id(0))


@pytest.mark.parametrize("splits", [2, 3, 7])
def test_last_program_sums_the_splits_in_order_and_resets_its_counter(splits):
    """Values whose float32 sum depends on the order (large terms that cancel, small ones that are lost or kept);
    the output must be the left-to-right sum exactly, rounded to the output's dtype, in two launches on the same
    counters (a counter left non-zero would leave the second launch's output unwritten: NaN)."""
    m, n, block_n = 3, 45, 16
    gen = torch.Generator().manual_seed(splits)
    values = torch.randn(splits, m, n, generator=gen) * torch.tensor([1e4, 1.0, -1e4, 1e-4, 7.0, 1e4, -1e4])[:splits,
                                                                                                           None, None]
    values = values.to(DEVICE)
    expected = values[0].clone()
    for s in range(1, splits):
        expected += values[s]
    tiles = triton.cdiv(n, block_n)
    counters = split_k.tile_counters(torch.device(DEVICE), tiles)
    for out_dtype in (torch.float32, torch.float16):
        out = torch.full((m, n), float("nan"), dtype=out_dtype, device=DEVICE)
        partial = torch.empty(splits, m, n, dtype=torch.float32, device=DEVICE)
        _splits_kernel[(tiles, splits)](values, out, partial, counters, m, n, BLOCK_N=block_n, BLOCK_M=4)
        assert torch.equal(out, expected.to(out_dtype)), out_dtype
        assert not counters[:tiles].any()


def test_counters_grow_but_not_during_graph_capture(monkeypatch):
    device = torch.device(DEVICE)
    small = split_k.tile_counters(device, 5)
    assert small.numel() >= 5 and not small.any()
    larger = split_k.tile_counters(device, small.numel() + 1)
    assert larger.numel() > small.numel() and split_k.tile_counters(device, 5) is larger
    if device.type == "cuda":
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        with pytest.raises(RuntimeError, match="during CUDA graph capture"):
            split_k.tile_counters(device, larger.numel() + 1)
