"""GatedAttention's long-chunk routing (layers/attention.py) on the CPU (the GPU when there is one: the merge
kernels are Triton's, run by its interpreter without one): a fresh prompt and a chunk after its
cached prefix go to the cuDNN paths (ops/attention/cuda_sdpa, cuDNN replaced by a float64 stand-in) and give what
the paged path gives, with a bf16 cache and with an fp8 cache whose scales are not 1 (the fp8 cache is read back,
k_scale folded into the softmax scale, v_scale onto the output)."""

import pytest
import torch
from torch.nn.attention import SDPBackend

from deltaserve.layers import attention
from deltaserve.layers.attention import GatedAttention
from deltaserve.layers.batch import ForwardBatch
from deltaserve.layers.rotary import PartialRotary
from deltaserve.ops.attention import cuda_sdpa, reference
from tests.ops.interpreter import math_cudnn_attention, use_math_cudnn

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HEADS, KV_HEADS, HEAD_DIM, HIDDEN, BLOCK = 4, 2, 16, 32, 4
PREFIX, CHUNK = 16, 13  # the chunk after the prefix pads to one 16-row bucket


def build_layer(kv_dtype, k_scale, v_scale):
    torch.manual_seed(0)
    layer = GatedAttention(HIDDEN, HEADS, KV_HEADS, HEAD_DIM, PartialRotary(HEAD_DIM, 8, 10000.0, 64), 1e-6)
    layer.to(DEVICE, torch.bfloat16).fuse()
    blocks = -(-(PREFIX + CHUNK) // BLOCK) + 1  # block 0 unused
    layer.k_cache = torch.zeros(blocks, BLOCK, KV_HEADS, HEAD_DIM, dtype=kv_dtype, device=DEVICE)
    layer.v_cache = torch.zeros_like(layer.k_cache)
    layer.k_scale, layer.v_scale = k_scale, v_scale
    return layer


def run_prompt(layer, hidden):
    """The prompt's first PREFIX tokens as one fresh step, then the rest as a chunk after them."""
    blocks = [list(range(1, 1 + -(-(PREFIX + CHUNK) // BLOCK)))]
    qkv = hidden @ layer.in_weight.T  # [T, q+gate, k, v]
    with torch.no_grad():
        first = layer(qkv[:PREFIX], ForwardBatch.build([0], [PREFIX], blocks, [1], BLOCK, DEVICE))
        second = layer(qkv[PREFIX:], ForwardBatch.build([PREFIX], [CHUNK], blocks, [1], BLOCK, DEVICE))
    return torch.cat([first, second]).float()


@pytest.mark.parametrize("kv_dtype, k_scale, v_scale", [(torch.bfloat16, 1.0, 1.0),
                                                         (torch.float8_e4m3fn, 0.5, 2.0)])
def test_cudnn_routes_match_the_paged_path(monkeypatch, kv_dtype, k_scale, v_scale):
    hidden = torch.randn(PREFIX + CHUNK, HIDDEN, generator=torch.Generator().manual_seed(1)).bfloat16().to(DEVICE)
    monkeypatch.setattr(attention, "SDPA_PREFIX_ALIGN", PREFIX)
    paged = run_prompt(build_layer(kv_dtype, k_scale, v_scale), hidden)

    use_math_cudnn(monkeypatch, cuda_sdpa)
    calls = []
    monkeypatch.setattr(cuda_sdpa, "_cudnn_attention", lambda *args, **kw: calls.append(1) or
                        math_cudnn_attention(*args, **kw))
    monkeypatch.setattr(cuda_sdpa, "_SDPA_BACKENDS", [SDPBackend.MATH])
    monkeypatch.setattr(cuda_sdpa, "SDPA_BUCKET", 16)
    monkeypatch.setattr(cuda_sdpa, "attention_output_gate", reference.attention_output_gate)
    fresh_calls, run_fresh = [], cuda_sdpa.fresh_causal_attention
    monkeypatch.setattr(cuda_sdpa, "fresh_causal_attention", lambda *args, **kw: fresh_calls.append(1) or
                        run_fresh(*args, **kw))
    # the layer's test of the path, without its CUDA check
    monkeypatch.setattr(GatedAttention, "_sdpa_path", lambda self, q, batch: batch.max_query_len >= CHUNK)
    routed = run_prompt(build_layer(kv_dtype, k_scale, v_scale), hidden)

    assert fresh_calls and calls, "both steps should have taken the cuDNN paths"
    torch.testing.assert_close(routed, paged, atol=3e-2, rtol=3e-2)
    # the tolerance is bf16 rounding; a forgotten scale would be off by 2x
    assert (routed - paged).abs().max() < 0.1 * paged.abs().max()
