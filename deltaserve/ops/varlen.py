"""Shared checks of op inputs: varlen offsets ("tokens of N sequences concatenated") and state pools."""


def sequence_bounds(cu_seqlens, num_tokens: int, num_seqs: int, name: str = "cu_seqlens") -> list[tuple[int, int]]:
    """[(start, end)] token range of each sequence; ValueError unless `cu_seqlens` is a valid [N+1] prefix sum
    of non-negative lengths that ends at num_tokens. Reads the offsets to the CPU (reference ops only)."""
    if cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point() or cu_seqlens.numel() != num_seqs + 1:
        raise ValueError(f"{name} must be an integer [N+1] tensor with N={num_seqs}, got dtype {cu_seqlens.dtype} "
                         f"shape {tuple(cu_seqlens.shape)}")
    offsets = cu_seqlens.tolist()
    if offsets[0] != 0 or offsets[-1] != num_tokens or any(b < a for a, b in zip(offsets, offsets[1:])):
        raise ValueError(f"{name} must start at 0, never decrease and end at T={num_tokens}, got {offsets}")
    return list(zip(offsets[:-1], offsets[1:]))


def check_state_pool(state_pool, state_slots) -> None:
    """ValueError unless the pool can be updated in place (contiguous) and the slots are an integer [N] tensor."""
    if not state_pool.is_contiguous():
        raise ValueError("state_pool must be contiguous: it is updated in place")
    if state_slots.dim() != 1 or state_slots.is_floating_point():
        raise ValueError(f"state_slots must be an integer [N] tensor, got {state_slots.dtype} "
                         f"{tuple(state_slots.shape)}")
