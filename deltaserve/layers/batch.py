"""ForwardBatch: the flattened tensors every layer reads for one forward pass.

The tokens of N sequences are concatenated ("varlen"): sequence n owns rows
cu_seqlens_q[n] : cu_seqlens_q[n+1] of every [T, ...] activation. The model runner builds one per step
(`ForwardBatch.build`), or points one at its static CUDA-graph buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from deltaserve.device import to_device


@dataclass
class MidChunkSaves:
    """GDN checkpoints taken inside a prefill step: sequence n's state after its first `offset` new tokens is
    copied to a checkpoint slot, then the step goes on (GatedDeltaNet; the scheduler plans them, see
    cache/cache_manager.py). P saves; each saved sequence is split at its save point into a head and a tail."""

    # The step with every saved sequence split in two: [N + P] segments. Heads keep their working slot and
    # initial state; tails run from zeros into their checkpoint slot (overwritten right after) and are then
    # run again from the state at the save point.
    split_cu_seqlens: torch.Tensor  # [N+P+1] int64
    split_cu_seqlens_cpu: torch.Tensor  # the same on the CPU
    split_state_slots: torch.Tensor  # [N+P] int64
    split_has_initial_state: torch.Tensor  # [N+P] bool
    split_max_query_len: int
    working_slots: torch.Tensor  # [P] int64
    checkpoint_slots: torch.Tensor  # [P] int64
    save_rows: torch.Tensor  # [P] int64, row of each save point (the first tail token) in the step
    tail_rows: torch.Tensor  # [R] int64, rows of all tail tokens, tail after tail
    tail_cu_seqlens: torch.Tensor  # [P+1] int64, over tail_rows
    tail_cu_seqlens_cpu: torch.Tensor
    tail_has_initial_state: torch.Tensor  # [P] bool, all True
    tail_max_len: int
    min_offset: int  # the fewest new tokens any saved sequence has before its save point

    @classmethod
    def build(cls, cu: np.ndarray, state_slots: list[int], has_initial: np.ndarray,
              saves: list[tuple[int, int, int]], device) -> "MidChunkSaves":
        """cu: [N+1] the step's cu_seqlens; saves: (sequence, offset, checkpoint slot), sequences ascending."""
        offsets = {seq: (offset, slot) for seq, offset, slot in saves}
        bounds, slots, initial = [0], [], []
        for n in range(len(cu) - 1):
            if n in offsets:
                offset, checkpoint = offsets[n]
                bounds += [cu[n] + offset, cu[n + 1]]
                slots += [state_slots[n], checkpoint]
                initial += [bool(has_initial[n]), False]
            else:
                bounds.append(cu[n + 1])
                slots.append(state_slots[n])
                initial.append(bool(has_initial[n]))
        split_cu = np.asarray(bounds, dtype=np.int64)
        save_rows = np.asarray([cu[seq] + offset for seq, offset, _ in saves], dtype=np.int64)
        tail_ends = np.asarray([cu[seq + 1] for seq, _, _ in saves], dtype=np.int64)
        tail_lens = tail_ends - save_rows
        tail_cu = np.zeros(len(saves) + 1, dtype=np.int64)
        np.cumsum(tail_lens, out=tail_cu[1:])
        tail_rows = np.concatenate([np.arange(a, b) for a, b in zip(save_rows, tail_ends)])

        def t(array):
            return to_device(array, device)

        return cls(
            split_cu_seqlens=t(split_cu), split_cu_seqlens_cpu=torch.from_numpy(split_cu),
            split_state_slots=t(np.asarray(slots, dtype=np.int64)), split_has_initial_state=t(np.asarray(initial)),
            split_max_query_len=int(np.diff(split_cu).max()),
            working_slots=t(np.asarray([state_slots[seq] for seq, _, _ in saves], dtype=np.int64)),
            checkpoint_slots=t(np.asarray([slot for _, _, slot in saves], dtype=np.int64)),
            save_rows=t(save_rows), tail_rows=t(tail_rows), tail_cu_seqlens=t(tail_cu),
            tail_cu_seqlens_cpu=torch.from_numpy(tail_cu), tail_has_initial_state=t(np.ones(len(saves), dtype=bool)),
            tail_max_len=int(tail_lens.max()),
            min_offset=min(offset for _, offset, _ in saves),
        )


@dataclass
class PaddedChunk:
    """How the GDN layers run a padded single-chunk step of R rows (worker/cuda_graph.py): one sequence's L new
    tokens then R - L padding rows, with every launch's shape the same whatever L and wherever a checkpoint falls,
    so that one CUDA graph serves them all.

    fla's chunked kernels run all R rows as one sequence on the chunk's state slot, the write strength and log
    decay of the rows from `stop` on set to 0: the state passes through those rows unchanged and ends as the
    state after `stop` rows (stop = L, or the save point of a checkpoint inside the step). That state is copied
    to `checkpoint_slot` (the dummy slot 0 when the step saves none), and so are the conv inputs before `stop`.
    Then a window of the last B (a block) rows runs again on the recurrent kernel as three sequences: the rows
    before `stop` (dummy slot, discarded), [stop, L) continuing the chunk's slot (none without a checkpoint), the
    padding (dummy slot); the middle one's outputs replace fla's."""

    keep: torch.Tensor  # [R] bool: row < stop
    fla_cu_seqlens: torch.Tensor  # [2] int64: 0, R
    fla_cu_seqlens_cpu: torch.Tensor  # the same on the CPU
    fla_chunk_indices: torch.Tensor | None  # fla's chunk index of one R-row sequence (GPU only)
    checkpoint_slot: torch.Tensor  # [1] int64
    conv_rows: torch.Tensor  # [W-1] int64: the rows just before `stop` (the conv state there)
    window_rows: torch.Tensor  # [B] int64: rows ws .. ws + B - 1, ws = min(stop, R - B)
    window_cu_seqlens: torch.Tensor  # [4] int64: 0, stop - ws, L - ws, B
    window_slots: torch.Tensor  # [3] int64: 0, the chunk's slot, 0
    window_has_initial_state: torch.Tensor  # [3] bool: False, True, False
    window_redo: torch.Tensor  # [B] bool: the window's rows in [stop, L)


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
    max_query_len: int  # the most new tokens of any sequence (1 in a decode batch)
    # cu_seqlens_q on the CPU (prefill only): lets fla's chunked kernels plan without a device sync; one
    # object per step, since fla caches what it derives from it by identity
    cu_seqlens_cpu: torch.Tensor | None
    is_decode: bool  # every sequence has one new token and continues from its cached state
    num_computed_cpu: tuple[int, ...] = ()  # tokens each sequence has cached before this step (built steps)
    mid_saves: MidChunkSaves | None = None  # GDN checkpoints inside this (prefill) step
    # a padded single-chunk step's GDN plan (see PaddedChunk); None: the GDN layers follow cu_seqlens_q
    padded: PaddedChunk | None = None

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def prefix_free(self) -> bool:
        """No sequence has cached tokens: every one starts at position 0 (False when unknown, as in graphs)."""
        return bool(self.num_computed_cpu) and not any(self.num_computed_cpu)

    @classmethod
    def build(cls, num_computed: list[int], query_lens: list[int], block_ids: list[list[int]],
              state_slots: list[int], block_size: int, device: torch.device | str = "cpu",
              block_table_width: int | None = None,
              mid_saves: list[tuple[int, int, int]] = ()) -> "ForwardBatch":
        """Build from per-sequence lists: tokens already in the cache, new tokens, KV block ids, state slot;
        mid_saves: (sequence, offset, checkpoint slot) of the GDN checkpoints inside the step."""
        computed = np.asarray(num_computed, dtype=np.int64)
        qlens = np.asarray(query_lens, dtype=np.int64)
        cu = np.zeros(len(qlens) + 1, dtype=np.int64)
        np.cumsum(qlens, out=cu[1:])
        # position of every new token: computed[n] + 0 .. qlens[n]-1, without a Python loop over tokens
        seq_of_token = np.repeat(np.arange(len(qlens)), qlens)  # [T]
        positions = computed[seq_of_token] + np.arange(cu[-1]) - cu[:-1][seq_of_token]
        width = block_table_width or max((len(b) for b in block_ids), default=1) or 1
        table = np.zeros((len(block_ids), width), dtype=np.int32)
        for i, blocks in enumerate(block_ids):
            table[i, : len(blocks)] = blocks
        slots = table[seq_of_token, positions // block_size].astype(np.int64) * block_size + positions % block_size

        def t(array):
            return to_device(array, device)

        return cls(
            positions=t(positions),
            cu_seqlens_q=t(cu),
            seq_lens=t(computed + qlens),
            block_tables=t(table),
            slot_mapping=t(slots),
            state_slots=t(np.asarray(state_slots, dtype=np.int64)),
            has_initial_state=t(computed > 0),
            logits_indices=t(cu[1:] - 1),
            max_query_len=int(qlens.max()) if len(qlens) else 0,
            cu_seqlens_cpu=torch.from_numpy(cu),
            # a sequence that starts now takes the prefill path, which zeroes its state first
            is_decode=bool(np.all((qlens == 1) & (computed > 0))),
            num_computed_cpu=tuple(computed.tolist()),
            mid_saves=MidChunkSaves.build(cu, state_slots, computed > 0, list(mid_saves), device) if mid_saves else None,
        )
