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
def patch_interpreter_float_rounding() -> None:
    """Triton 3.6's interpreter rounds 16/32-bit floats to fp8e4nv without carrying into the exponent (124.3 becomes
    64, not 128) and with ties away from zero, and truncates float32 to bf16; the GPU rounds both to nearest even
    (cvt.rn). Route those conversions through torch's casts (round to nearest even; kernels clamp to +-448 before
    an fp8 cast)."""
    import numpy as np

    original = interpreter._convert_float
    sources = {"fp32": (np.float32, torch.float32), "fp16": (np.float16, torch.float16),
               "bf16": (np.uint16, torch.bfloat16)}
    targets = {"fp8e4nv": (torch.float8_e4m3fn, torch.uint8), "bf16": (torch.bfloat16, torch.int16)}

    def convert(values, input_dtype, output_dtype, rounding_mode):
        if output_dtype.name not in targets or input_dtype.name not in sources or input_dtype == output_dtype:
            return original(values, input_dtype, output_dtype, rounding_mode)
        np_type, torch_type = sources[input_dtype.name]
        cast, bits = targets[output_dtype.name]
        flat = torch.from_numpy(np.frombuffer(values.tobytes(), dtype=np_type).copy()).view(torch_type)
        out = flat.to(cast).view(bits).numpy()
        return out.view(np.uint8 if bits == torch.uint8 else np.uint16).reshape(values.shape)

    interpreter._convert_float = convert


@functools.cache
def patch_interpreter_bf16_dot() -> None:
    """Triton 3.6's interpreter multiplies bf16 dot operands as their raw 16-bit patterns; widen them to float32
    (exact) first, so that kernels with bf16 tiles can run on the CPU (their products and sums in float32, as on the
    GPU's tensor cores)."""
    import numpy as np
    import triton.language as tl

    builder = interpreter.InterpreterBuilder
    original = builder.create_dot

    def widen(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        bits = handle.data.astype(np.uint32) << 16
        return interpreter.TensorHandle(bits.view(np.float32), tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    builder.create_dot = create_dot
