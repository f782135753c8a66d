"""Triton kernels for the causal depthwise conv1d over the GDN conv-state pool (GPU path of `ops.conv1d`).

Same contract as `deltaserve.ops.conv1d.conv_prefill` / `conv_decode` (see `reference.py`): channel-last
tokens x [T, D], weight [D, W], and a pool of conv states [S, D, W-1] holding each sequence's last W-1 inputs,
oldest first. The kernels read a sequence's state straight from its pool slot and write the new state back in
place: no gathered copies.

Prefill is two launches. The first computes y: one row of programs per sequence for its first W-1 tokens
(the only ones whose taps read the pool's initial state), then one per block of tokens for the rest, each
token finding its sequence by a binary search in cu_seqlens on the device (no host sync). The second writes
each sequence's final W-1 inputs to its slot. They cannot be one launch: the program that owns a sequence's
last tokens would overwrite the slot while the program that owns its first tokens may still be reading the
initial state.

Prefill can write y as up to three channel segments (the layer's q | k | v), each a contiguous [T, d] tensor,
one after another in one allocation: fla's chunked kernels copy strided q/k/v views, so the layer asks for
the segments. The channel grid walks segment 0's blocks, then segment 1's, then 2's: no block straddles two.

In-place updates load every old value a program needs, pass a barrier, then store: Triton may give one
element to several threads, and without the barrier one thread's write could precede another's read.

Accumulation is float32; x and the state pool may be bf16 or float32.
"""

import torch
import triton
import triton.language as tl

from deltaserve.ops import pdl
from deltaserve.ops.conv1d.reference import check_split
from deltaserve.ops.pdl import wait_for_previous_kernel
from deltaserve.ops.varlen import check_state_pool

_ACTIVATIONS = ("silu", None)

# Tile sizes (channels per program, tokens per program for the prefill output).
_DECODE_BLOCK_D = 256
_DECODE_WARPS = 4
_PREFILL_BLOCK_T = 32
_PREFILL_BLOCK_D = 128
_PREFILL_WARPS = 4
_SAVE_BLOCK_D = 256
_SAVE_WARPS = 4


@triton.jit
def _apply_activation(acc, SILU: tl.constexpr):
    if SILU:
        acc = acc * tl.sigmoid(acc)
    return acc


@triton.jit
def _conv_decode_kernel(
    x, weight, y, state_pool, state_slots,
    channels, stride_x_row, stride_y_row, stride_pool_slot,
    WIDTH: tl.constexpr, W_PAD: tl.constexpr, SILU: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False,
):
    """One program per (sequence, channel block): y = act(window . weight), then shift the slot's state.

    The window [BLOCK_D, W] is the slot's W-1 columns followed by the new input, oldest first."""
    wait_for_previous_kernel(PDL)
    seq = tl.program_id(0)
    chans = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # [BLOCK_D]
    cols = tl.arange(0, W_PAD)  # [W_PAD], window columns (W padded to a power of two)
    chan_ok = chans < channels
    slot = tl.load(state_slots + seq).to(tl.int64)
    rows = state_pool + slot * stride_pool_slot + chans[:, None] * (WIDTH - 1)  # [BLOCK_D, 1] column-0 pointers

    x_new = tl.load(x + seq * stride_x_row + chans, mask=chan_ok, other=0.0).to(tl.float32)  # [BLOCK_D]
    is_new = cols[None, :] == WIDTH - 1
    old = tl.load(rows + cols[None, :], mask=chan_ok[:, None] & (cols[None, :] < WIDTH - 1), other=0.0)
    window = tl.where(is_new, x_new[:, None], old.to(tl.float32))  # [BLOCK_D, W_PAD]
    w_mask = chan_ok[:, None] & (cols[None, :] < WIDTH)
    taps = tl.load(weight + chans[:, None] * WIDTH + cols[None, :], mask=w_mask, other=0.0).to(tl.float32)
    acc = _apply_activation(tl.sum(window * taps, axis=1), SILU)  # [BLOCK_D]

    # New state column c = window column c + 1 (read again from memory: cheaper than a register shuffle).
    shifted = tl.load(rows + cols[None, :] + 1, mask=chan_ok[:, None] & (cols[None, :] < WIDTH - 2), other=0.0)
    shifted = tl.where(cols[None, :] == WIDTH - 2, x_new[:, None], shifted.to(tl.float32))  # [BLOCK_D, W_PAD]
    # Every read of these state rows, by any thread of the program, completes before the first write.
    tl.debug_barrier()
    state_mask = chan_ok[:, None] & (cols[None, :] < WIDTH - 1)
    tl.store(rows + cols[None, :], shifted.to(state_pool.dtype.element_ty), mask=state_mask)
    tl.store(y + seq * stride_y_row + chans, acc.to(y.dtype.element_ty), mask=chan_ok)


@triton.jit
def _sequence_of(tokens, cu_seqlens, num_seqs, search_steps):
    """[BLOCK_T] index of the sequence owning each token: the largest n < N with cu_seqlens[n] <= token.

    Binary search keeping cu_seqlens[lo] <= token < cu_seqlens[hi]; empty sequences are skipped because a
    later start equal to theirs wins. Tokens past the end land on N-1 (callers mask them)."""
    lo = tl.zeros_like(tokens)
    hi = tl.zeros_like(tokens) + num_seqs
    for _ in range(search_steps):
        mid = (lo + hi) // 2
        go_right = tl.load(cu_seqlens + mid) <= tokens
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid)
    return lo


@triton.jit
def _segment_channels(block, split1, split2, channels, BLOCK_D: tl.constexpr):
    """Output channel block `block` of the grid -> (its channels [BLOCK_D], its segment's bounds lo, hi).

    Segments are [0, split1), [split1, split2), [split2, channels); each gets cdiv(width, BLOCK_D) blocks."""
    blocks0 = tl.cdiv(split1, BLOCK_D)
    blocks01 = blocks0 + tl.cdiv(split2 - split1, BLOCK_D)
    in0 = block < blocks0
    in1 = block < blocks01
    lo = tl.where(in0, 0, tl.where(in1, split1, split2))
    hi = tl.where(in0, split1, tl.where(in1, split2, channels))
    first = tl.where(in0, 0, tl.where(in1, blocks0, blocks01))  # the segment's first block
    return lo + (block - first) * BLOCK_D + tl.arange(0, BLOCK_D), lo, hi


@triton.jit
def _conv_taps(
    x, weight, state_pool, state_slots, has_initial_state, seq, start, tokens, tok_ok, chans, chan_ok,
    stride_x_row, stride_pool_slot, WIDTH: tl.constexpr, READ_STATE: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """[BLOCK_T, BLOCK_D] float32 sum over taps of w[tap] * input(t - (W-1) + tap), before the activation.

    An input before its sequence's first token comes from the slot's initial state (zero without one) if
    READ_STATE, else it is zero. seq, start: [BLOCK_T], each token's sequence and that sequence's first token."""
    if READ_STATE:
        slot = tl.load(state_slots + seq, mask=tok_ok, other=0).to(tl.int64)  # [BLOCK_T]
        has_state = tl.load(has_initial_state + seq, mask=tok_ok, other=0) != 0  # [BLOCK_T]
    acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    for tap in tl.static_range(WIDTH):
        src = tokens - (WIDTH - 1 - tap)  # [BLOCK_T], the token this tap reads
        x_mask = (tok_ok & (src >= start))[:, None] & chan_ok[None, :]
        inputs = tl.load(x + src[:, None] * stride_x_row + chans[None, :], mask=x_mask, other=0.0).to(tl.float32)
        if READ_STATE and tap < WIDTH - 1:  # the last tap reads the token itself, never the state
            # src is (start - src) steps before the sequence: state column (W-1) - (start - src), in [0, W-2].
            col = (WIDTH - 1) + src - start  # [BLOCK_T]
            state_mask = (tok_ok & (src < start) & has_state)[:, None] & chan_ok[None, :]
            state_ptr = state_pool + slot[:, None] * stride_pool_slot + chans[None, :] * (WIDTH - 1) + col[:, None]
            inputs += tl.load(state_ptr, mask=state_mask, other=0.0).to(tl.float32)  # masks are disjoint
        tap_weight = tl.load(weight + chans * WIDTH + tap, mask=chan_ok, other=0.0).to(tl.float32)  # [BLOCK_D]
        acc += inputs * tap_weight[None, :]
    return acc


@triton.jit
def _store_segment(y, acc, tokens, tok_ok, chans, chan_ok, lo, hi, num_tokens, SILU: tl.constexpr):
    """y[t, c] = act(acc) into the output segment [lo, hi), which y holds as a contiguous [T, hi - lo] block."""
    segment = y + lo.to(tl.int64) * num_tokens
    out = segment + tokens[:, None] * (hi - lo) + (chans - lo)[None, :]
    acc = _apply_activation(acc, SILU)
    tl.store(out, acc.to(y.dtype.element_ty), mask=tok_ok[:, None] & chan_ok[None, :])


# The batch's sizes are not specialised on (Triton would compile a variant per divisibility of each): one
# kernel serves every batch, compiled at warm-up instead of at the first batch of a new shape (~0.5 s each).
@triton.jit(do_not_specialize=["num_tokens", "num_seqs", "search_steps"])
def _conv_prefill_kernel(
    x, weight, y, state_pool, state_slots, has_initial_state, cu_seqlens,
    num_tokens, channels, split1, split2, num_seqs, search_steps, stride_x_row, stride_pool_slot,
    WIDTH: tl.constexpr, SILU: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr, HEAD_T: tl.constexpr,
):
    """y[t] = act(sum_tap w[tap] * input(t - (W-1) + tap)), grid (N + token blocks, channel blocks).

    Program row n < N: the first W-1 tokens of sequence n, whose inputs before the sequence come from the
    slot's initial state (zero without one). Row N + b: tokens b * BLOCK_T .. + BLOCK_T except each
    sequence's first W-1, without state loads: the bulk of the work, on about half the registers of a tile
    that may read the state (~120 instead of 213 on sm_90, 32 x 128 bf16), so twice the programs fit on an
    SM. Both sum the same products in the same order (a skipped state term is an exact zero).
    Reads the pool only; `_conv_save_state_kernel` writes it afterwards."""
    chans, lo, hi = _segment_channels(tl.program_id(1), split1, split2, channels, BLOCK_D)  # [BLOCK_D]
    chan_ok = chans < hi
    row = tl.program_id(0)
    if row < num_seqs:  # the head of sequence n = row (names differ from the other branch's: Triton merges those)
        head_seq = tl.zeros([HEAD_T], dtype=tl.int64) + row  # [HEAD_T]
        head_start = tl.load(cu_seqlens + head_seq)
        head_tokens = head_start + tl.arange(0, HEAD_T)  # [HEAD_T]
        head_ok = (tl.arange(0, HEAD_T) < WIDTH - 1) & (head_tokens < tl.load(cu_seqlens + head_seq + 1))
        head_acc = _conv_taps(x, weight, state_pool, state_slots, has_initial_state, head_seq, head_start,
                              head_tokens, head_ok, chans, chan_ok, stride_x_row, stride_pool_slot, WIDTH, True,
                              HEAD_T, BLOCK_D)
        _store_segment(y, head_acc, head_tokens, head_ok, chans, chan_ok, lo, hi, num_tokens, SILU)
    else:
        # int64 token ids: token * row stride can pass 2^31 for long prompts with D = 10240
        tokens = ((row - num_seqs) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)  # [BLOCK_T]
        tok_ok = tokens < num_tokens
        seq = _sequence_of(tokens, cu_seqlens, num_seqs, search_steps)  # [BLOCK_T]
        start = tl.load(cu_seqlens + seq)  # [BLOCK_T], first token of each token's sequence
        acc = _conv_taps(x, weight, state_pool, state_slots, has_initial_state, seq, start, tokens, tok_ok, chans,
                         chan_ok, stride_x_row, stride_pool_slot, WIDTH, False, BLOCK_T, BLOCK_D)
        not_head = tokens - start >= WIDTH - 1  # heads were written by their own programs
        _store_segment(y, acc, tokens, tok_ok & not_head, chans, chan_ok, lo, hi, num_tokens, SILU)


@triton.jit
def _conv_save_state_kernel(
    x, state_pool, state_slots, has_initial_state, cu_seqlens,
    channels, stride_x_row, stride_pool_slot,
    WIDTH: tl.constexpr, W_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program per (sequence, channel block): the slot's new columns are the last W-1 entries of
    concat(initial state, the sequence's inputs); a sequence shorter than W-1 keeps its newest old columns."""
    seq = tl.program_id(0)
    chans = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # [BLOCK_D]
    cols = tl.arange(0, W_PAD)  # [W_PAD], state columns (W-1 used)
    chan_ok = chans < channels
    start = tl.load(cu_seqlens + seq)
    end = tl.load(cu_seqlens + seq + 1)
    slot = tl.load(state_slots + seq).to(tl.int64)
    has_state = tl.load(has_initial_state + seq) != 0
    rows = state_pool + slot * stride_pool_slot + chans[:, None] * (WIDTH - 1)  # [BLOCK_D, 1] column-0 pointers

    src = end - (WIDTH - 1) + cols  # [W_PAD], the token whose input lands in each column
    col_ok = chan_ok[:, None] & (cols[None, :] < WIDTH - 1)
    from_x = tl.load(x + src[None, :] * stride_x_row + chans[:, None], mask=col_ok & (src >= start)[None, :],
                     other=0.0)
    # Before the sequence's start, column c keeps old column c + length (= (W-1) + src - start).
    old_cols = cols + (end - start)  # [W_PAD]
    state_mask = col_ok & (src < start)[None, :] & has_state
    from_state = tl.load(rows + old_cols[None, :], mask=state_mask, other=0.0)
    new = from_x.to(tl.float32) + from_state.to(tl.float32)  # [BLOCK_D, W_PAD]; one of the two is zero
    tl.debug_barrier()  # all reads of the slot's old columns complete before the first write
    tl.store(rows + cols[None, :], new.to(state_pool.dtype.element_ty), mask=col_ok)


def conv_decode(x, weight, state_pool, state_slots, activation="silu"):
    """One conv step per sequence, in place in the pool.

    x: [N, D] bf16/float32; weight: [D, W]; state_pool: [S, D, W-1] (contiguous), the slots state_slots [N]
    are shifted left by one column and x appended; activation: "silu" or None. Returns y: [N, D] in x.dtype."""
    width = _check_conv_inputs(x, weight, state_pool, state_slots, activation)
    num_seqs, channels = x.shape
    if state_slots.shape[0] != num_seqs:
        raise ValueError(f"state_slots must have one slot per row of x ({num_seqs}), got {state_slots.shape[0]}")
    weight = weight.contiguous()
    y = torch.empty(num_seqs, channels, dtype=x.dtype, device=x.device)
    if num_seqs == 0:
        return y
    grid = (num_seqs, triton.cdiv(channels, _DECODE_BLOCK_D))
    _conv_decode_kernel[grid](
        x, weight, y, state_pool, state_slots,
        channels, x.stride(0), y.stride(0), state_pool.stride(0),
        WIDTH=width, W_PAD=triton.next_power_of_2(width), SILU=activation == "silu", BLOCK_D=_DECODE_BLOCK_D,
        num_warps=_DECODE_WARPS, **pdl.launch_args(x.device),
    )
    return y


def conv_prefill(x, weight, state_pool, state_slots, has_initial_state, cu_seqlens, activation="silu",
                 split=None):
    """Causal conv over varlen sequences, state read from and written back to the pool.

    x: [T, D] bf16/float32 (N sequences concatenated); weight: [D, W]; state_pool: [S, D, W-1] (contiguous);
    state_slots: [N] int64; has_initial_state: [N] bool (False: zeros before the sequence); cu_seqlens: [N+1]
    int64 on x's device (trusted: not checked, that would need a host sync). Returns y: [T, D] in x.dtype;
    with split (up to three channel counts summing to D) instead one contiguous [T, d] tensor per count, cut
    one after another from a single allocation."""
    width = _check_conv_inputs(x, weight, state_pool, state_slots, activation)
    num_tokens, channels = x.shape
    num_seqs = state_slots.shape[0]
    if tuple(has_initial_state.shape) != (num_seqs,) or has_initial_state.dtype != torch.bool:
        raise ValueError(
            f"has_initial_state must be a bool [N={num_seqs}] tensor, got {has_initial_state.dtype} "
            f"{tuple(has_initial_state.shape)}"
        )
    if tuple(cu_seqlens.shape) != (num_seqs + 1,) or cu_seqlens.is_floating_point():
        raise ValueError(
            f"cu_seqlens must be an integer [N+1={num_seqs + 1}] tensor, got {cu_seqlens.dtype} "
            f"{tuple(cu_seqlens.shape)}"
        )
    segments = (channels,) if split is None else check_split(split, channels)
    split1, split2 = (sum(segments[:i]) for i in (1, 2))  # where segments 1 and 2 start (D if absent)
    weight = weight.contiguous()
    flat = torch.empty(num_tokens * channels, dtype=x.dtype, device=x.device)  # [T*d0 | T*d1 | T*d2]
    parts = [part.view(num_tokens, d) for part, d in zip(flat.split([num_tokens * d for d in segments]), segments)]
    y = parts[0] if split is None else tuple(parts)
    if num_seqs == 0:
        return y
    if num_tokens > 0:
        search_steps = max(1, (num_seqs - 1).bit_length())  # ceil(log2(N)) halvings of [0, N)
        token_blocks = triton.cdiv(num_tokens, _PREFILL_BLOCK_T)
        channel_blocks = sum(triton.cdiv(d, _PREFILL_BLOCK_D) for d in segments)
        _conv_prefill_kernel[(num_seqs + token_blocks, channel_blocks)](
            x, weight, flat, state_pool, state_slots, has_initial_state, cu_seqlens,
            num_tokens, channels, split1, split2, num_seqs, search_steps, x.stride(0), state_pool.stride(0),
            WIDTH=width, SILU=activation == "silu", BLOCK_T=_PREFILL_BLOCK_T,
            BLOCK_D=_PREFILL_BLOCK_D, HEAD_T=triton.next_power_of_2(width - 1), num_warps=_PREFILL_WARPS,
        )
    # Launched after the first kernel on the same stream, so every initial-state read is done.
    _conv_save_state_kernel[(num_seqs, triton.cdiv(channels, _SAVE_BLOCK_D))](
        x, state_pool, state_slots, has_initial_state, cu_seqlens,
        channels, x.stride(0), state_pool.stride(0),
        WIDTH=width, W_PAD=triton.next_power_of_2(width), BLOCK_D=_SAVE_BLOCK_D, num_warps=_SAVE_WARPS,
    )
    return y


def _check_conv_inputs(x, weight, state_pool, state_slots, activation):
    """Raise ValueError naming the first bad argument; return the kernel width W."""
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [rows, D] with unit channel stride, got shape {tuple(x.shape)} "
                         f"strides {x.stride()}")
    channels = x.shape[1]
    if weight.dim() != 2 or weight.shape[0] != channels or weight.shape[1] < 2:
        raise ValueError(f"weight must be [D={channels}, W >= 2], got shape {tuple(weight.shape)}")
    width = weight.shape[1]
    if state_pool.dim() != 3 or tuple(state_pool.shape[1:]) != (channels, width - 1):
        raise ValueError(f"state_pool must be [S, D, W-1] = [S, {channels}, {width - 1}], "
                         f"got {tuple(state_pool.shape)}")
    check_state_pool(state_pool, state_slots)
    return width
