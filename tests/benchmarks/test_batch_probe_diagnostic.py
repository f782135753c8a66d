"""batch_probe's diagnostic kernel (the skinny GEMM's loop with parts taken out), in Triton's CPU interpreter:
each mode computes what its docstring says, and mode 2 is the real product."""

import pytest
import torch

pytest.importorskip("triton")

from benchmarks import batch_probe  # noqa: E402
from tests.ops.interpreter import patch_interpreter_index  # noqa: E402
from tests.tolerance import assert_within, both_sides, gamma  # noqa: E402

patch_interpreter_index()


def test_diagnostic_modes():
    if torch.cuda.is_available():
        pytest.skip("the interpreter's check; on the GPU the probe itself runs it")
    gen = torch.Generator().manual_seed(0)
    rows, n, k, tile = 16, 32, 64, (16, 32, 1, 4, 1)
    x, weight = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen)
    blocks = weight.view(n, k // tile[1], tile[1])  # [N, K blocks, BK]
    expected = (weight.sum(1, keepdim=True).expand(n, rows),  # the weights' sum, in every column
                blocks.sum(1) @ x[:, : tile[1]].T,  # every K block's dot against the first x tile
                weight @ x.T)  # the product
    # each a k-term float32 reduction on both sides: gamma(k) on the sum of its terms' magnitudes
    magnitudes = (weight.abs().sum(1, keepdim=True).expand(n, rows), blocks.abs().sum(1) @ x[:, : tile[1]].abs().T,
                  weight.abs() @ x.abs().T)
    for mode, (want, magnitude) in enumerate(zip(expected, magnitudes)):
        out = torch.empty(n, rows)
        batch_probe._diagnostic(x, weight, out, tile, mode)
        one_side = gamma(k, torch.float32) * magnitude.double()
        assert_within(out, want, both_sides(one_side, one_side), f"mode {mode}")


def test_diagnose_refuses_row_counts_a_dot_tile_cannot_take(capsys):
    with pytest.raises(SystemExit):
        batch_probe.main(["--diagnose", "24"])
    assert "--diagnose: row counts are powers of two from 16" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--gdn-tail", "64,x"], "--gdn-tail: expected comma-separated positive whole numbers, got '64,x'"),
    (["--prefill-rows", "0"], "--prefill-rows: expected comma-separated positive whole numbers, got '0'"),
    (["--rows", "128"], "--rows: the skinny GEMM serves 1 to 64 rows, got '128'"),
    (["--rows", "64", "--only", "5120:5121"], "--only: '5120:5121' is not a weight shape of this model"),
])
def test_bad_probe_flags_are_refused_by_name(argv, message, capsys, ckpt_qwen3_5):
    with pytest.raises(SystemExit):
        batch_probe.main([str(ckpt_qwen3_5), *argv])
    assert message in capsys.readouterr().err


def test_small_products_are_the_plain_blocks_quantized_checkpoints_keep():
    """--small probes what the quantized configs run in bf16 apart: 27B's GDN [b|a] (48 value heads, hidden 5,120)
    and 35B-A3B's router joined with the shared gate (256 experts + 1, padded to 272 rows, hidden 2,048)."""
    shapes = batch_probe.small_products()
    assert (96, 5120) in shapes and (64, 2048) in shapes and (272, 2048) in shapes
