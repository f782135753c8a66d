"""Plain-torch causal depthwise conv1d: the CPU oracle behind which the GPU kernels drop in.

Each channel d of the GDN input (the flat [q | k | v] projection) is convolved over time with its own kernel
weight[d] of width W (4 in Qwen3.5), causally: output t sees inputs t - (W-1) .. t. The state carried between
steps is the last W-1 *inputs* (pre-conv, pre-activation), layout [N, D, W-1] as in Dao-AILab causal-conv1d
and vLLM ("DS"); FLA instead keeps W columns.

Tokens are channel-last and time-major ([T, D]), varlen: N sequences concatenated, split by cu_seqlens.
"""

import torch

from deltaserve.ops.varlen import sequence_bounds

_ACTIVATIONS = ("silu", None)


def causal_conv1d(x, weight, initial_state, cu_seqlens, activation: str | None = "silu"):
    """Causal depthwise conv over varlen sequences (prefill).

    Args:
        x: [T, D], any float dtype (tokens of N sequences concatenated).
        weight: [D, W], any float dtype (the HF conv1d.weight squeezed from [D, 1, W]).
        initial_state: [N, D, W-1], the W-1 inputs before each sequence (zeros for a fresh one).
        cu_seqlens: [N+1] int64, cumulative sequence lengths, cu_seqlens[0] == 0, cu_seqlens[-1] == T.
        activation: "silu" or None.

    y[t] = act(sum_j weight[:, j] * x_padded[t - (W-1) + j]), x_padded = concat(initial_state, x_seq) over time;
    computed in float32.

    Returns:
        y: [T, D] in x.dtype.
        final_state: [N, D, W-1] in initial_state.dtype, the last W-1 columns of concat(initial_state, x_seq):
            a sequence shorter than W-1 keeps the newest of its older state columns.
    """
    _check_activation(activation)
    num_tokens, channels = _check_x_weight(x, weight)
    width = weight.shape[1]
    if initial_state.dim() != 3 or tuple(initial_state.shape[1:]) != (channels, width - 1):
        raise ValueError(
            f"initial_state must be [N, D, W-1] = [N, {channels}, {width - 1}], got {tuple(initial_state.shape)}"
        )
    bounds = sequence_bounds(cu_seqlens, num_tokens, initial_state.shape[0])

    weight32 = weight.float()
    y = torch.empty(num_tokens, channels, dtype=torch.float32, device=x.device)
    final_state = torch.empty_like(initial_state)
    for seq, (start, end) in enumerate(bounds):
        length = end - start
        padded = torch.cat([initial_state[seq].float(), x[start:end].float().T], dim=1)  # [D, W-1+L]
        acc = torch.zeros(channels, length, dtype=torch.float32, device=x.device)  # [D, L]
        for tap in range(width):
            # Tap j multiplies the input (W-1-j) steps before each output position.
            acc += weight32[:, tap : tap + 1] * padded[:, tap : tap + length]
        y[start:end] = acc.T
        final_state[seq] = padded[:, length:]  # last W-1 columns
    return _activate(y, activation).to(x.dtype), final_state


def causal_conv1d_update(x, conv_state, weight, activation: str | None = "silu"):
    """One conv step per sequence (decode); updates conv_state IN PLACE.

    Args:
        x: [N, D], any float dtype (one new token per sequence).
        conv_state: [N, D, W-1], the last W-1 inputs of each sequence; shifted left by one column and the new
            input appended (cast to conv_state.dtype).
        weight: [D, W].
        activation: "silu" or None.

    Returns:
        y: [N, D] in x.dtype, computed in float32.
    """
    _check_activation(activation)
    num_seqs, channels = _check_x_weight(x, weight)
    width = weight.shape[1]
    if tuple(conv_state.shape) != (num_seqs, channels, width - 1):
        raise ValueError(
            f"conv_state must be [N, D, W-1] = {(num_seqs, channels, width - 1)}, got {tuple(conv_state.shape)}"
        )
    window = torch.cat([conv_state.float(), x.float()[:, :, None]], dim=-1)  # [N, D, W], oldest first
    y = (window * weight.float()).sum(dim=-1)  # [N, D]
    conv_state.copy_(window[:, :, 1:])
    return _activate(y, activation).to(x.dtype)


def check_split(split, channels: int) -> tuple[int, ...]:
    """ValueError unless `split` is one to three non-negative channel counts summing to D; returns a tuple."""
    split = tuple(split)
    if not 1 <= len(split) <= 3 or any(not isinstance(d, int) or d < 0 for d in split) or sum(split) != channels:
        raise ValueError(f"split must be 1 to 3 non-negative ints summing to D={channels}, got {split}")
    return split


def _activate(y, activation):
    return torch.nn.functional.silu(y) if activation == "silu" else y


def _check_activation(activation):
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")


def _check_x_weight(x, weight):
    """Raise ValueError unless x is [rows, D] and weight is [D, W >= 1]; return (rows, D)."""
    if x.dim() != 2:
        raise ValueError(f"x must be [T, D], got shape {tuple(x.shape)}")
    if weight.dim() != 2 or weight.shape[0] != x.shape[1] or weight.shape[1] < 1:
        raise ValueError(f"weight must be [D={x.shape[1]}, W >= 1], got shape {tuple(weight.shape)}")
    return x.shape[0], x.shape[1]
