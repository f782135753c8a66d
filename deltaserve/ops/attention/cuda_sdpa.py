"""The cuDNN attention paths for long prefill chunks (the GPU path of `ops.attention`'s
`fresh_causal_attention` and `chunk_over_prefix_attention`), through PyTorch's SDPA.

    fresh_causal_attention        prompts without a cached prefix: SDPA on the new K/V itself
    chunk_over_prefix_attention   one long chunk after a cached prefix: cuDNN in parts, merged by log-sum-exp
    warm_up_cudnn_attention       builds cuDNN's plans at startup

cuDNN is about twice as fast as our paged kernel on long chunks (docs/performance.md) but builds an execution
plan per shape: chunks are padded to multiples of SDPA_BUCKET and the plans built at startup. With `gate=`,
the output is o * sigmoid(gate) (`cuda.attention_output_gate` for fresh prompts; for a chunk after its prefix
the kernel that merges its parts applies it, `merge_attention_output`).

An fp8 cache (it holds K / k_scale and V / v_scale) is served as the paged kernel serves it: the callers pass
K/V as the cache holds them, cast to q's dtype (exact), the softmax scale times k_scale, and v_scale, by which
the output is multiplied.
"""

import functools
import logging
import math

import torch
import triton
import triton.language as tl

from deltaserve.ops.attention.cuda import _unit_last_stride, attention_output_gate
from deltaserve.ops.attention.cuda_prefill import output_gate
from deltaserve.ops.attention.reference import check_gate

__all__ = ["chunk_over_prefix_attention", "fresh_causal_attention", "warm_up_cudnn_attention"]

logger = logging.getLogger(__name__)

# chunk_over_prefix_attention gathers the cached prefix about this many tokens (whole blocks) at a time
PREFIX_PIECE_TOKENS = 32768
# cuDNN builds an execution plan per shape: chunks are padded to a multiple of this so that few shapes occur
SDPA_BUCKET = 1024
# Rows (query tokens of one head) per program of the merge kernels: [16, 256] float32 tiles
MERGE_ROWS = 16
_SDPA_BACKENDS = None  # None: cuDNN, else flash; CPU tests set PyTorch's math backend


def fresh_causal_attention(q, k, v, cu_seqlens_cpu, scale: float, gate=None, v_scale: float = 1.0):
    """Causal attention of prompts that all start at position 0, on their new K/V (no cache read), through
    PyTorch's SDPA: cuDNN's fused kernel when it takes the shapes, else flash attention.

    cuDNN runs about twice the rate of our paged kernel there (`python -m benchmarks.attention_probe`:
    docs/performance.md, 'Prefill attention'). Each prompt is padded with zero rows to a multiple of
    SDPA_BUCKET (causal: the real rows never see the padding), so that cuDNN meets few shapes (see
    `warm_up_cudnn_attention`). q: [T, n_heads, hd]; k, v: [T, n_kv, hd], bf16 or float16, unit stride in hd;
    cu_seqlens_cpu: [N+1] on the CPU (no device sync); gate: None or [T, n_heads, hd] in q.dtype, applied by
    `attention_output_gate` in place of each prompt's copy into o; v_scale multiplies the output (fp8 caches'
    V / v_scale). Returns o: [T, n_heads, hd] in q.dtype (times sigmoid(gate)), or None if SDPA refused (logged;
    the caller runs the paged kernel).
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if q.dtype not in (torch.bfloat16, torch.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"fresh_causal_attention takes bf16 or float16 q, k, v of one dtype, got {q.dtype}, "
                         f"{k.dtype}, {v.dtype}")
    check_gate(gate, q)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    bounds = cu_seqlens_cpu.tolist()
    try:
        with sdpa_kernel(_SDPA_BACKENDS or [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]):
            for start, end in zip(bounds[:-1], bounds[1:]):
                if end == start:
                    continue
                length = _bucket(end - start)
                # [1, heads, L, hd]; SDPA's GQA serves each KV head's group of query heads
                q_s, k_s, v_s = (_pad_rows(x[start:end], length).transpose(0, 1)[None] for x in (q, k, v))
                o = torch.nn.functional.scaled_dot_product_attention(q_s, k_s, v_s, is_causal=True, scale=scale,
                                                                     enable_gqa=True)
                o = o[0].transpose(0, 1)[: end - start]  # [L, heads, hd]
                if v_scale != 1.0:
                    o = o * v_scale
                if gate is None:
                    out[start:end] = o
                else:
                    attention_output_gate(o, gate[start:end], out=out[start:end])
    except RuntimeError as exc:
        _warn_once(f"PyTorch SDPA refused a prompt's attention ({str(exc).splitlines()[0][:200]}); "
                   "the paged kernel serves it")
        return None
    return out


def warm_up_cudnn_attention(num_heads: int, num_kv_heads: int, head_dim: int, dtype, device,
                            max_chunk_tokens: int) -> None:
    """Build cuDNN's attention plans at startup: its first use in a process costs seconds and each new shape
    tens of milliseconds, which would otherwise land on the first requests. Covers every bucketed
    fresh-prompt length up to max_chunk_tokens, the log-sum-exp check of `chunk_over_prefix_attention` and its
    merge kernels."""
    if dtype not in (torch.bfloat16, torch.float16):
        return
    if _cudnn_lse_base(device, dtype, head_dim):
        warm_up_merges(num_heads, head_dim, dtype, device)
    for length in range(SDPA_BUCKET, _bucket(max_chunk_tokens) + 1, SDPA_BUCKET):
        q = torch.zeros(length, num_heads, head_dim, dtype=dtype, device=device)
        kv = torch.zeros(length, num_kv_heads, head_dim, dtype=dtype, device=device)
        if fresh_causal_attention(q, kv, kv, torch.tensor([0, length]), head_dim ** -0.5) is None:
            return


def warm_up_merges(num_heads: int, head_dim: int, dtype, device) -> None:
    """Compile every variant of the merge kernels that `chunk_over_prefix_attention` launches (a first part and a
    later one; the output with and without a gate), on operands laid out as its own: a chunk after a prefix of
    more than one piece would otherwise compile one while serving."""
    length = SDPA_BUCKET
    acc = torch.zeros(num_heads, length, head_dim, dtype=torch.float32, device=device)
    lse = torch.zeros(num_heads, length, dtype=torch.float32, device=device)
    folded = torch.zeros(num_heads, length, head_dim, dtype=dtype, device=device)  # the prefix pieces' layout
    causal = torch.zeros(length, num_heads, head_dim, dtype=dtype, device=device).transpose(0, 1)  # the chunk's
    gate = torch.zeros(length, num_heads, 2 * head_dim, dtype=dtype, device=device)[..., head_dim:]  # as the layer's
    for first in (True, False):
        merge_attention_part(acc, lse, folded, lse, first=first)
    for layer_gate in (gate, None):
        merge_attention_output(acc, lse, causal, lse, length - 1, dtype, gate=layer_gate)


def _bucket(length: int) -> int:
    """length rounded up to a multiple of SDPA_BUCKET."""
    return -(-length // SDPA_BUCKET) * SDPA_BUCKET


def _pad_rows(x, length: int):
    """x [L, ...] followed by zero rows up to `length` (x itself when L == length)."""
    if x.shape[0] == length:
        return x
    padded = x.new_zeros((length, *x.shape[1:]))
    padded[: x.shape[0]] = x
    return padded


@functools.cache
def _warn_once(message: str) -> None:
    logger.warning(message)


def chunk_over_prefix_attention(q, k, v, k_cache, v_cache, block_table_row, prefix_len: int, scale: float,
                                gate=None, v_scale: float = 1.0):
    """Causal attention of ONE sequence's chunk (queries and new K/V) after prefix_len cached tokens, through
    cuDNN in parts merged by their log-sum-exp: the queries against the prefix (no mask: every query sees all
    of it), in pieces of PREFIX_PIECE_TOKENS whose K/V are gathered from the paged cache into a contiguous
    copy, then against the chunk itself (causal). Each part is folded into a float32 running output by one
    Triton pass (`merge_attention_part`), and the last one also writes the gated output token-major
    (`merge_attention_output`), rather than as several torch ops a part.

    cuDNN runs about twice our paged kernel's rate without a mask and with a plain causal one, but slower than
    it with a bottom-right causal mask over prefix + chunk (benchmarks/attention_probe.py: docs/performance.md,
    'Prefill attention'); hence the parts. Pieces bound the transient copies (27B: 134 MB of K/V per
    piece, and the float32 [heads, L, hd] running output), which stay below the activation peak the startup profile
    measures (sampling's buffers, freed before the next forward). Returns None where cuDNN's log-sum-exp
    cannot be had; the caller then runs the paged kernel.
    The chunk is padded to a multiple of SDPA_BUCKET (causal: its padding rows come last and are dropped).
    q: [L, n_heads, hd]; k, v: [L, n_kv, hd] (q's dtype, bf16 or float16); caches: [blocks, bs, n_kv, hd] of
    q's dtype or fp8 (its pieces cast to q's dtype; scale then holds k_scale, and v_scale multiplies the
    output); block_table_row: [>= ceil(prefix_len / bs)] int32; gate: None or [L, n_heads, hd] in q.dtype,
    applied in the last merge, rounded as `attention_output_gate` rounds. Returns o: [L, n_heads, hd] (times
    sigmoid(gate)).
    """
    check_gate(gate, q)
    if not _cudnn_lse_base(q.device, q.dtype, q.shape[-1]):
        return None
    try:
        return _chunk_over_prefix(q, k, v, k_cache, v_cache, block_table_row, prefix_len, scale, gate, v_scale)
    except RuntimeError as exc:
        _warn_once(f"cuDNN attention refused a chunk after a cached prefix ({str(exc).splitlines()[0][:200]}); "
                   "the paged kernel serves it")
        return None


def _chunk_over_prefix(q, k, v, k_cache, v_cache, block_table_row, prefix_len: int, scale: float, gate,
                       v_scale: float):
    """`chunk_over_prefix_attention` once cuDNN's log-sum-exp convention is known."""
    real_length = q.shape[0]
    q, k, v = (_pad_rows(x, _bucket(real_length)) for x in (q, k, v))  # causal: padding rows come last
    length, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    # Against the prefix rows need no order: fold each KV head's G query heads into its rows (GQA for free).
    # Query head h = kv * G + g, so the folded rows [n_kv, G * L] are the head-major rows [H, L].
    q_folded = q.view(length, num_kv_heads, group, head_dim).permute(1, 2, 0, 3).reshape(
        1, num_kv_heads, group * length, head_dim)
    # the prefix parts' running output and log-sum-exp, head-major as cuDNN writes them
    acc = torch.empty(num_heads, length, head_dim, dtype=torch.float32, device=q.device)  # [H, L, hd]
    lse_acc = torch.empty(num_heads, length, dtype=torch.float32, device=q.device)  # [H, L]
    if prefix_len == 0:  # no prefix part: the chunk's own part is the output (weight exp(-inf) = 0 for acc)
        acc.zero_()
        lse_acc.fill_(float("-inf"))
    piece_blocks = PREFIX_PIECE_TOKENS // block_size
    for first_block in range(0, -(-prefix_len // block_size), piece_blocks):
        tokens = min(prefix_len - first_block * block_size, piece_blocks * block_size)
        blocks = block_table_row[first_block:first_block + -(-tokens // block_size)].long()
        # [1, n_kv, tokens, hd] in q's dtype (an fp8 cache's values cast exactly)
        k_piece = k_cache[blocks].flatten(0, 1)[:tokens].to(q.dtype).permute(1, 0, 2)[None]
        v_piece = v_cache[blocks].flatten(0, 1)[:tokens].to(q.dtype).permute(1, 0, 2)[None]
        out, lse = _cudnn_attention(q_folded, k_piece, v_piece, scale, causal=False)  # [1, n_kv, G*L, hd]
        merge_attention_part(acc, lse_acc, out.reshape(num_heads, length, head_dim), lse.reshape(num_heads, length),
                             first=first_block == 0)
    # Against the chunk: causal; cuDNN serves the KV heads' groups of query heads itself (GQA: 4 KV heads for 24)
    out, lse = _cudnn_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], scale,
                                causal=True)  # [1, H, L, hd], [1, H, L, 1]
    return merge_attention_output(acc, lse_acc, out[0], lse.reshape(num_heads, length), real_length, q.dtype,
                                  v_scale, gate)


@triton.jit
def _merge_rows(acc, lse_acc, part, lse_part, head, rows, dims, length, num_rows, stride_part_head, stride_part_row,
                stride_lse_head, stride_lse_row, HEAD_DIM: tl.constexpr, FIRST: tl.constexpr):
    """Rows [R] of one head (those below num_rows): the running (acc [H, length, hd], lse_acc [H, length]) joined
    with a part's output and log-sum-exp (the part alone when FIRST). Returns (output [R, D] float32,
    log-sum-exp [R], the rows' mask [R, D])."""
    row_ok = rows < num_rows
    mask = row_ok[:, None] & (dims[None, :] < HEAD_DIM)  # [R, D]
    part_tile = tl.load(part + head * stride_part_head + rows[:, None] * stride_part_row + dims[None, :], mask=mask,
                        other=0.0).to(tl.float32)  # [R, D]
    lse_p = tl.load(lse_part + head * stride_lse_head + rows * stride_lse_row, mask=row_ok, other=0.0)  # [R]
    if FIRST:
        return part_tile, lse_p, mask
    acc_tile = tl.load(acc + (head * length + rows[:, None]) * HEAD_DIM + dims[None, :], mask=mask, other=0.0)
    lse_a = tl.load(lse_acc + head * length + rows, mask=row_ok, other=0.0)  # [R]
    top = tl.maximum(lse_a, lse_p)
    weight_a, weight_p = tl.exp(lse_a - top), tl.exp(lse_p - top)  # [R] each; the larger one is 1
    total = weight_a + weight_p
    merged = (acc_tile * weight_a[:, None] + part_tile * weight_p[:, None]) / total[:, None]
    return merged, top + tl.log(total), mask


@triton.jit(do_not_specialize=["length"])  # one variant whatever the chunk's length
def _merge_part_kernel(acc, lse_acc, part, lse_part, length, stride_part_head, stride_part_row, stride_lse_head,
                       stride_lse_row, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, ROWS: tl.constexpr,
                       FIRST: tl.constexpr):
    """Grid (cdiv(L, ROWS), H): (acc, lse_acc) [H, L, hd] / [H, L] take in one part, in place."""
    # int64 offsets: head * length * hd, or a row times the gate's row stride, may pass 2^31 for long chunks
    head = tl.program_id(1).to(tl.int64)
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)  # [R]
    dims = tl.arange(0, HEAD_DIM_PAD)  # [D]
    merged, lse, mask = _merge_rows(acc, lse_acc, part, lse_part, head, rows, dims, length, length,
                                    stride_part_head, stride_part_row, stride_lse_head, stride_lse_row, HEAD_DIM,
                                    FIRST)
    tl.store(acc + (head * length + rows[:, None]) * HEAD_DIM + dims[None, :], merged, mask=mask)
    tl.store(lse_acc + head * length + rows, lse, mask=rows < length)


@triton.jit(do_not_specialize=["length", "real_length"])
def _merge_output_kernel(acc, lse_acc, part, lse_part, gate, out, length, real_length, v_scale,
                         stride_part_head, stride_part_row, stride_lse_head, stride_lse_row, stride_gate_tok,
                         stride_gate_head, stride_out_tok, stride_out_head, HEAD_DIM: tl.constexpr,
                         HEAD_DIM_PAD: tl.constexpr, ROWS: tl.constexpr, GATED: tl.constexpr):
    """Grid (cdiv(real_length, ROWS), H): out [real_length, H, hd] = (acc [H, length, hd] joined with the last
    part) * v_scale, times sigmoid(gate) when GATED (rounded as `output_gate` says), else cast to out's dtype."""
    # int64 offsets: head * length * hd, or a row times the gate's row stride, may pass 2^31 for long chunks
    head = tl.program_id(1).to(tl.int64)
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)  # [R]
    dims = tl.arange(0, HEAD_DIM_PAD)  # [D]
    merged, _, mask = _merge_rows(acc, lse_acc, part, lse_part, head, rows, dims, length, real_length,
                                  stride_part_head, stride_part_row, stride_lse_head, stride_lse_row, HEAD_DIM, False)
    merged = merged * v_scale
    if GATED:
        merged = output_gate(merged, gate + rows[:, None] * stride_gate_tok + head * stride_gate_head + dims[None, :],
                             mask, out.dtype.element_ty)
    tl.store(out + rows[:, None] * stride_out_tok + head * stride_out_head + dims[None, :],
             merged.to(out.dtype.element_ty), mask=mask)


def merge_attention_part(acc, lse_acc, part, lse_part, first: bool) -> None:
    """Fold one part's attention (softmax-normalized over its keys) into the running output, in place:
    acc [H, L, hd] float32 and lse_acc [H, L] float32 (natural log), contiguous; part [H, L, hd] (any float
    dtype and strides, unit stride in hd); lse_part [H, L] float32. first: the part alone (acc is not read)."""
    num_heads, length, head_dim = acc.shape
    _check_merge_operands(acc, lse_acc, part, lse_part)
    part = _unit_last_stride(part)
    _merge_part_kernel[(triton.cdiv(length, MERGE_ROWS), num_heads)](
        acc, lse_acc, part, lse_part, length, part.stride(0), part.stride(1), lse_part.stride(0), lse_part.stride(1),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim), ROWS=MERGE_ROWS, FIRST=first,
    )


def merge_attention_output(acc, lse_acc, part, lse_part, real_length: int, dtype, v_scale: float = 1.0, gate=None):
    """The last part folded in and the layer's output written token-major in one pass: returns
    [real_length, H, hd] in dtype = (acc joined with part) * v_scale, times sigmoid(gate) when gate
    ([>= real_length, H, hd], unit stride in hd) is given. acc, lse_acc, part, lse_part as `merge_attention_part`
    takes them, over a length of at least real_length (padding rows are dropped)."""
    num_heads, length, head_dim = acc.shape
    _check_merge_operands(acc, lse_acc, part, lse_part)
    if not 0 <= real_length <= length:
        raise ValueError(f"real_length must be in [0, {length}] (the parts' length), got {real_length}")
    if gate is not None and (gate.dim() != 3 or gate.shape[0] < real_length or gate.shape[1:] != acc.shape[::2]):
        raise ValueError(f"gate must be [>= {real_length}, {num_heads}, {head_dim}], got {tuple(gate.shape)}")
    out = torch.empty(real_length, num_heads, head_dim, dtype=dtype, device=acc.device)
    if real_length == 0:
        return out
    part = _unit_last_stride(part)
    gated = gate is not None
    if gated:
        gate = _unit_last_stride(gate)
    gate_strides = (gate.stride(0), gate.stride(1)) if gated else (0, 0)
    _merge_output_kernel[(triton.cdiv(real_length, MERGE_ROWS), num_heads)](
        acc, lse_acc, part, lse_part, gate if gated else acc, out, length, real_length, float(v_scale),
        part.stride(0), part.stride(1), lse_part.stride(0), lse_part.stride(1), *gate_strides,
        out.stride(0), out.stride(1), HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        ROWS=MERGE_ROWS, GATED=gated,
    )
    return out


def _check_merge_operands(acc, lse_acc, part, lse_part) -> None:
    """The merge kernels' operands, as `merge_attention_part` takes them (shapes only: the kernels trust values)."""
    if acc.dim() != 3 or acc.dtype != torch.float32 or not acc.is_contiguous():
        raise ValueError(f"acc must be a contiguous float32 [H, L, hd], got {acc.dtype} {tuple(acc.shape)}")
    if part.shape != acc.shape:
        raise ValueError(f"part must have acc's shape {tuple(acc.shape)}, got {tuple(part.shape)}")
    if lse_acc.shape != acc.shape[:2] or lse_part.shape != acc.shape[:2] or not lse_acc.is_contiguous():
        raise ValueError(f"lse_acc (contiguous) and lse_part must be {tuple(acc.shape[:2])}, got "
                         f"{tuple(lse_acc.shape)} and {tuple(lse_part.shape)}")


def _cudnn_attention(q, k, v, scale: float, causal: bool):
    """cuDNN's fused attention on [1, heads, rows, hd] tensors (k and v may have fewer heads: each serves a group
    of q's, GQA); returns (out [1, heads, rows, hd], natural-log lse [1, heads, rows, 1] as cuDNN shapes it)."""
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False, scale=scale)[:2]
    if _cudnn_lse_base(q.device, q.dtype, q.shape[-1]) == "log2":
        lse = lse * math.log(2.0)
    return out, lse


@functools.cache
def _cudnn_lse_base(device, dtype, head_dim: int) -> str | None:
    """What cuDNN's log-sum-exp holds on this build, found once: with all scores 0 over 64 keys it is ln 64
    (natural) or 6 (base 2). None when the op fails or gives anything else: callers fall back."""
    q = torch.zeros(1, 1, 16, head_dim, dtype=dtype, device=device)
    kv = torch.randn(1, 1, 64, head_dim, device=device).to(dtype)
    try:
        _, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, kv, kv, None, True, 0.0, False, False,
                                                                     scale=1.0)[:2]
        value = lse.float().flatten()[0].item()
    except (RuntimeError, NotImplementedError) as exc:
        logger.warning("cuDNN attention with log-sum-exp is unavailable (%s); long chunks over cached prefixes "
                       "use the paged kernel", str(exc).splitlines()[0][:200])
        return None
    if abs(value - math.log(64)) < 1e-2:
        return "natural"
    if abs(value - 6.0) < 1e-2:
        return "log2"
    logger.warning("cuDNN attention's log-sum-exp is neither natural nor base 2 (%s for ln 64); long chunks over "
                   "cached prefixes use the paged kernel", value)
    return None
