"""GDN checkpoints inside a prefill step (layers/batch.MidChunkSaves, GatedDeltaNet._prefill_with_checkpoints):
the step's outputs and final states are those of the same step without saves, and each checkpoint slot holds
exactly what a step stopping at the save point leaves in its working slot (conv and recurrent state)."""

from functools import partial

import torch
import torch.nn.functional as F

from deltaserve.layers.batch import ForwardBatch, MidChunkSaves
from tests.model.helpers import assert_paths_agree, gdn_layer_with_random_states, layer_bound

# Two sequences: slot 1 continues from its state (6 cached tokens), slot 2 starts fresh. Checkpoint slots 5, 6.
COMPUTED, LENGTHS, SLOTS, BLOCKS = [6, 0], [21, 13], [1, 2], [[1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11]]
SAVES = [(0, 16, 5), (1, 8, 6)]  # (sequence, offset into its new tokens, checkpoint slot)


def test_split_layout():
    saves = MidChunkSaves.build([0, 21, 34], SLOTS, [True, False], SAVES, "cpu")
    assert saves.split_cu_seqlens.tolist() == [0, 16, 21, 29, 34]
    assert saves.split_state_slots.tolist() == [1, 5, 2, 6]  # tails run into their checkpoint slots first
    assert saves.split_has_initial_state.tolist() == [True, False, False, False]
    assert saves.tail_rows.tolist() == [16, 17, 18, 19, 20, 29, 30, 31, 32, 33]
    assert saves.tail_cu_seqlens.tolist() == [0, 5, 10] and saves.tail_max_len == 5
    assert (saves.save_rows.tolist(), saves.min_offset, saves.split_max_query_len) == ([16, 29], 8, 16)


def test_saves_inside_a_step_equal_a_step_that_stops_there(ckpt_qwen3_5):
    cfg, layer, gen = gdn_layer_with_random_states(ckpt_qwen3_5, num_state_slots=8)
    start = layer.conv_state.clone(), layer.ssm_state.clone()
    projected = F.linear(torch.randn(sum(LENGTHS), cfg.hidden_size, generator=gen), layer.in_weight)

    def run(lengths, rows, mid_saves=()):
        layer.conv_state.copy_(start[0])
        layer.ssm_state.copy_(start[1])
        batch = ForwardBatch.build(COMPUTED, lengths, BLOCKS, SLOTS, block_size=4, mid_saves=mid_saves)
        return layer(projected[rows], batch), layer.conv_state.clone(), layer.ssm_state.clone()

    whole = torch.arange(sum(LENGTHS))
    plain, plain_conv, plain_ssm = run(LENGTHS, whole)
    saved, conv, ssm = run(LENGTHS, whole, SAVES)
    # split at the saves or not, the same float32 recurrence over at most the longest sequence's tokens
    bound = partial(layer_bound, cfg, max(c + n for c, n in zip(COMPUTED, LENGTHS)))
    assert_paths_agree(saved, plain, bound, "layer output")
    torch.testing.assert_close(conv[SLOTS], plain_conv[SLOTS], atol=0, rtol=0)
    assert_paths_agree(ssm[SLOTS], plain_ssm[SLOTS], bound, "recurrent state")
    # a step that stops at the save points leaves the checkpoints' contents in the working slots
    heads = [offset for _, offset, _ in SAVES]
    _, stop_conv, stop_ssm = run(heads, torch.cat([torch.arange(16), torch.arange(21, 29)]))
    checkpoints = [slot for _, _, slot in SAVES]
    torch.testing.assert_close(conv[checkpoints], stop_conv[SLOTS], atol=0, rtol=0)
    assert_paths_agree(ssm[checkpoints], stop_ssm[SLOTS], bound, "checkpointed state")
