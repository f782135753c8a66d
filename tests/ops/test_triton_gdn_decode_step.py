"""`ops/gdn/cuda.gdn_decode_step` (one decode token's conv, gated delta rule and gated output norm in one launch) in
Triton's CPU interpreter, against the three launches it replaces run on copies of the same pools: conv_decode,
gdn_decode with raw gates, and the gated RMS norm kernel (quantized for an FP8 product, or with a dp4a GEMV's parts).
Bit for bit: the same helpers compute every value (conv_step, _prepare_token, _delta_step, gated_norm,
quantize_block, store_x_parts) and the interpreter's sums do not depend on the tile. fp16 activations: the
interpreter has no bf16 arithmetic. The compiled kernel: tests/gpu/test_gdn_conv_gpu.py.
"""

import os

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("compiled kernels are tested by tests/gpu/test_gdn_conv_gpu.py", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from deltaserve.ops.conv1d import cuda as conv_kernels  # noqa: E402
from deltaserve.ops.gdn import cuda as gdn_kernels  # noqa: E402
from deltaserve.ops.norm import cuda as norm_kernels  # noqa: E402
from deltaserve.ops.quant_gemm.reference import Dp4aActivation, Fp8Activation  # noqa: E402
from deltaserve.ops.split_k import tile_counters  # noqa: E402
from tests.ops.interpreter import patch_interpreter_float_rounding, patch_interpreter_index  # noqa: E402

patch_interpreter_index()
patch_interpreter_float_rounding()

DTYPE = torch.float16
HK, K, HV, V, WIDTH = 2, 16, 6, 32, 4  # three value heads a key head
NUM_SLOTS = 7
EPS = 1e-6


def step_inputs(gen: torch.Generator, num_seqs: int = 1) -> dict:
    """A decode step's inputs as the layer has them: qkv, z, b, a column views of one projection row, the states in
    pools of NUM_SLOTS slots, the sequences' slots out of order."""
    conv_dim = 2 * HK * K + HV * V
    projected = torch.randn(num_seqs, conv_dim + HV * V + 2 * HV, generator=gen).to(DTYPE)
    qkv, z, b, a = projected.split([conv_dim, HV * V, HV, HV], dim=-1)
    a = a.clone()
    a[0, 0] = 30.0  # softplus's linear branch
    return dict(
        qkv=qkv, z=z.view(num_seqs, HV, V), a=a, b=b,
        conv_weight=(torch.randn(conv_dim, WIDTH, generator=gen) * 0.5).to(DTYPE),
        conv_pool=torch.randn(NUM_SLOTS, conv_dim, WIDTH - 1, generator=gen).to(DTYPE),
        A_log=torch.rand(HV, generator=gen).mul(15).add(1).log(), dt_bias=torch.randn(HV, generator=gen),
        state_pool=torch.randn(NUM_SLOTS, HV, K, V, generator=gen),
        state_slots=torch.randperm(NUM_SLOTS, generator=gen)[:num_seqs],
        norm_weight=(torch.randn(V, generator=gen) * 0.1 + 1).to(DTYPE))


def three_launches(inputs: dict, form, block_v: int):
    """What the layer launches at other steps: conv_decode, gdn_decode (raw gates), the gated norm kernel."""
    q, k, v = conv_kernels.conv_decode(inputs["qkv"], inputs["conv_weight"], inputs["conv_pool"],
                                       inputs["state_slots"]).split([HK * K, HK * K, HV * V], dim=-1)
    n = q.shape[0]
    o = gdn_kernels.gdn_decode(q.view(n, HK, K), k.view(n, HK, K), v.view(n, HV, V), inputs["a"], inputs["b"],
                               inputs["state_pool"], inputs["state_slots"], block_v=block_v, A_log=inputs["A_log"],
                               dt_bias=inputs["dt_bias"])
    norm = (o, inputs["z"], inputs["norm_weight"], EPS)
    if form == "fp8":
        return norm_kernels.gated_rms_norm(*norm, quant_block=V)
    return norm_kernels.gated_rms_norm(*norm, dp4a=form)


def one_launch(inputs: dict, form, block_v: int):
    return gdn_kernels.gdn_decode_step(**inputs, norm_eps=EPS, key_heads=HK, form=form, block_v=block_v)


def copied(inputs: dict) -> dict:
    return {name: t.clone() if name in ("conv_pool", "state_pool") else t for name, t in inputs.items()}


def assert_same(got, expected, form):
    if form == "fp8":
        assert isinstance(got, Fp8Activation) and got.block_k == V
        assert torch.equal(got.xq.view(torch.uint8), expected.xq.view(torch.uint8))
        assert torch.equal(got.sx, expected.sx)
    elif isinstance(form, tuple):
        assert isinstance(got, Dp4aActivation) and (got.group, got.low_high) == form
        for mine, theirs in zip((got.x, got.parts, got.x_scale, got.v_sum),
                                (expected.x, expected.parts, expected.x_scale, expected.v_sum)):
            assert torch.equal(mine, theirs)
    else:
        raise AssertionError(f"no form {form!r}")


@pytest.mark.parametrize("form", ["fp8", (32, False), (16, True)])
@pytest.mark.parametrize("block_v", [8, 32])  # four programs a head (shared q / k state, the norm's last), or one
def test_one_launch_equals_the_three_it_replaces(form, block_v):
    """Every output and both pools, bit for bit, over two steps (the second reads the conv and recurrent states the
    first wrote: q / k's by the last of their readers); the unused slots are untouched, and the counters are back at
    zero after each launch."""
    inputs = step_inputs(torch.Generator().manual_seed(block_v))
    before, after = copied(inputs), copied(inputs)
    for step in range(2):
        expected = three_launches(before, form, block_v)
        got = one_launch(after, form, block_v)
        assert torch.equal(after["conv_pool"], before["conv_pool"]), step
        assert torch.equal(after["state_pool"], before["state_pool"]), step
        assert_same(got, expected, form)
        assert not tile_counters(torch.device("cpu"), 1).any()
    unused = [s for s in range(NUM_SLOTS) if s not in inputs["state_slots"].tolist()]
    assert torch.equal(after["state_pool"][unused], inputs["state_pool"][unused])
    assert torch.equal(after["conv_pool"][unused], inputs["conv_pool"][unused])
    assert not torch.equal(after["conv_pool"], inputs["conv_pool"])


def test_bad_input_is_refused_by_name():
    inputs = step_inputs(torch.Generator().manual_seed(3))
    with pytest.raises(ValueError, match="form must be"):
        one_launch(copied(inputs), "normed", 8)
    with pytest.raises(ValueError, match="form must be"):
        one_launch(copied(inputs), (64, False), 8)
    with pytest.raises(ValueError, match="key_heads"):
        gdn_kernels.gdn_decode_step(**copied(inputs), norm_eps=EPS, key_heads=4, form="fp8")
    with pytest.raises(ValueError, match="z must be"):
        one_launch(dict(copied(inputs), z=inputs["z"][:, :2]), "fp8", 8)
    with pytest.raises(ValueError, match="one token"):
        one_launch(dict(copied(inputs), **step_inputs(torch.Generator().manual_seed(4), num_seqs=2)), "fp8", 8)
