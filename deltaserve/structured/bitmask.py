"""The grammar bitmask on its way to the logits: one int32 word per 32 token ids, bit t % 32 of word t // 32 set
when token t is allowed (xgrammar's layout). Filled on the host (matcher.py), copied to the logits' device and
applied there by xgrammar's kernel (Triton on CUDA, C++ on the CPU), outside any CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deltaserve.device import to_device


def bitmask_width(vocab_size: int) -> int:
    return -(-vocab_size // 32)


@dataclass
class GrammarMask:
    """What the sampler applies: the step's bitmask and the rows it constrains (other rows sample freely)."""

    bitmask: torch.Tensor  # [S, ceil(V/32)] int32, on the logits' device; rows not in `rows` are not read
    rows: list[int]


def apply_grammar_mask(logits: torch.Tensor, mask: GrammarMask) -> None:
    """In place: logits[row, t] = -inf for every constrained row and every token t its bitmask forbids.

    logits: [S, V] float32, contiguous (the sampler's private copy).
    """
    import xgrammar

    # on CUDA the row indices go over as a tensor copied without blocking (a list would be copied from pageable
    # memory); the CPU kernel takes the list
    rows = mask.rows if logits.device.type != "cuda" else to_device(mask.rows, logits.device, torch.int32)
    xgrammar.apply_token_bitmask_inplace(logits, mask.bitmask, vocab_size=logits.shape[1], indices=rows)


def warm_up(vocab_size: int, device: torch.device) -> None:
    """Compile the CUDA kernel's variants (one row, a multiple of 16 rows, any other count) before serving."""
    for rows in (1, 2, 16):
        logits = torch.zeros(rows, vocab_size, dtype=torch.float32, device=device)
        bitmask = torch.full((rows, bitmask_width(vocab_size)), -1, dtype=torch.int32, device=device)
        apply_grammar_mask(logits, GrammarMask(bitmask, list(range(rows))))
