"""ForwardBatch: the flattened tensors every layer reads for one forward pass.

The tokens of N sequences are concatenated ("varlen"): sequence n owns rows
cu_seqlens_q[n] : cu_seqlens_q[n+1] of every [T, ...] activation. The model runner builds one per step;
tests build them with `ForwardBatch.build`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    positions: torch.Tensor  # [T] int64, position of each token in its sequence
    cu_seqlens_q: torch.Tensor  # [N+1] int64, cumulative new-token counts
    seq_lens: torch.Tensor  # [N] int64, KV length of each sequence after this step
    block_tables: torch.Tensor  # [N, max_blocks] int32, KV block ids (unused entries 0 = null block)
    slot_mapping: torch.Tensor  # [T] int64, KV cache slot of each new token (block * block_size + offset)
    state_slots: torch.Tensor  # [N] int64, GDN state-pool slot of each sequence
    has_initial_state: torch.Tensor  # [N] bool, False where the sequence starts from zero state
    logits_indices: torch.Tensor  # [N] int64, row of each sequence's last token (the one to sample from)
    query_lens: list[int]  # [N] new tokens per sequence, on the CPU
    is_decode: bool  # every sequence has one new token and continues from its cached state

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @classmethod
    def build(cls, num_computed: list[int], query_lens: list[int], block_ids: list[list[int]],
              state_slots: list[int], block_size: int, device: torch.device | str = "cpu") -> "ForwardBatch":
        """Build from per-sequence lists: tokens already in the cache, new tokens, KV block ids, state slot."""
        positions, slots = [], []
        for computed, qlen, blocks in zip(num_computed, query_lens, block_ids):
            for pos in range(computed, computed + qlen):
                positions.append(pos)
                slots.append(blocks[pos // block_size] * block_size + pos % block_size)
        cu = [0]
        for qlen in query_lens:
            cu.append(cu[-1] + qlen)
        width = max((len(b) for b in block_ids), default=1) or 1
        table = torch.zeros(len(block_ids), width, dtype=torch.int32)
        for i, blocks in enumerate(block_ids):
            table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)

        def t(values, dtype=torch.int64):
            return torch.tensor(values, dtype=dtype, device=device)

        return cls(
            positions=t(positions),
            cu_seqlens_q=t(cu),
            seq_lens=t([c + q for c, q in zip(num_computed, query_lens)]),
            block_tables=table.to(device),
            slot_mapping=t(slots),
            state_slots=t(state_slots),
            has_initial_state=t([c > 0 for c in num_computed], torch.bool),
            logits_indices=t([c - 1 for c in cu[1:]]),
            query_lens=list(query_lens),
            # a sequence that starts now takes the prefill path, which zeroes its state first
            is_decode=all(q == 1 and c > 0 for q, c in zip(query_lens, num_computed)),
        )
