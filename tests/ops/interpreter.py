"""Support for the kernel tests that run in Triton's CPU interpreter (TRITON_INTERPRET=1), and a math stand-in
for cuDNN attention."""

import functools

import torch

from triton.runtime import interpreter


@functools.cache
def patch_interpreter_index() -> None:
    """Triton 3.6's interpreter turns scalars into loop bounds with int() on a 1-element array, which numpy
    >= 2.4 rejects (triton-lang/triton#9171); apply the upstream fix (squeeze first) once for this process."""
    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patched


def math_cudnn_attention(q, k, v, scale, causal):
    """A float64 stand-in for `ops/attention/cuda_sdpa._cudnn_attention` (GQA folded, natural-log lse), for testing the
    cuDNN paths' gathering, padding and merging on the CPU. q: [B, H, L, D]; k, v: [B, Hkv, S, D]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("bhld,bhsd->bhls", q.double(), k) * scale
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("bhls,bhsd->bhld", scores.softmax(-1), v).to(q.dtype), scores.logsumexp(-1).float()


def use_math_cudnn(monkeypatch, kernels) -> None:
    """Route the cuDNN attention of `kernels` (ops/attention/cuda_sdpa) through `math_cudnn_attention`."""
    monkeypatch.setattr(kernels, "_cudnn_lse_base", lambda *args: "natural")
    monkeypatch.setattr(kernels, "_cudnn_attention", math_cudnn_attention)


@functools.cache
def patch_interpreter_fp8_rounding() -> None:
    """Triton 3.6's interpreter rounds 16/32-bit floats to fp8e4nv without carrying into the exponent (124.3 becomes
    64, not 128) and with ties away from zero; the GPU's cvt.rn.satfinite rounds to nearest even. Route those
    conversions through torch's float8_e4m3fn cast (round to nearest even; the kernels clamp to +-448 first)."""
    import numpy as np
    import triton.language as tl

    original = interpreter._convert_float
    sources = {"fp32": (np.float32, torch.float32), "fp16": (np.float16, torch.float16),
               "bf16": (np.uint16, torch.bfloat16)}

    def convert(values, input_dtype, output_dtype, rounding_mode):
        if output_dtype != tl.float8e4nv or input_dtype.name not in sources:
            return original(values, input_dtype, output_dtype, rounding_mode)
        np_type, torch_type = sources[input_dtype.name]
        flat = torch.from_numpy(np.frombuffer(values.tobytes(), dtype=np_type).copy()).view(torch_type)
        return flat.to(torch.float8_e4m3fn).view(torch.uint8).numpy().reshape(values.shape)

    interpreter._convert_float = convert
