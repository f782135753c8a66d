"""A step asked only for its sampled rows (`sample_seqs`: the last layer attends and runs its MLP for those rows
alone) gives those rows' logits as the full step does, and writes the same KV cache and GDN states, on every
architecture, with none sampled, and with a Gated DeltaNet last layer (float32, CPU reference ops)."""

import dataclasses
from functools import partial

import pytest
import torch

from deltaserve.config import ModelConfig
from deltaserve.layers.batch import ForwardBatch
from deltaserve.model.loader import load_model
from deltaserve.worker.kv_cache import CacheShape, bind_caches
from tests.model.helpers import BLOCK_SIZE, assert_paths_agree, cache_tensors, model_bound

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _model(cfg: ModelConfig, path=None):
    model = load_model(path, cfg, torch.float32, "cpu", load_format="auto" if path else "dummy")
    bind_caches(model, CacheShape(num_blocks=64, block_size=BLOCK_SIZE, num_state_slots=8,
                                  kv_dtype=torch.float32, ssm_dtype=torch.float32), "cpu")
    return model


def _check_sampled_rows(model, vocab: int) -> None:
    gen = torch.Generator().manual_seed(5)
    blocks = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [11, 12, 13, 14, 15]]
    with torch.no_grad():  # sequence 0 has cached tokens, so the step attends over a prefix too
        model(torch.randint(0, vocab, (7,), generator=gen), ForwardBatch.build([0], [7], blocks[:1], [1], BLOCK_SIZE))
    batch = ForwardBatch.build([7, 0, 0], [9, 1, 12], blocks, [1, 2, 3], BLOCK_SIZE)
    ids = torch.randint(0, vocab, (22,), generator=gen)
    before = [t.clone() for t in cache_tensors(model)]

    def run(sample_seqs):
        for tensor, saved in zip(cache_tensors(model), before):
            tensor.copy_(saved)
        with torch.no_grad():
            hidden = model(ids, batch, sample_seqs)
        return hidden, [t.clone() for t in cache_tensors(model)]

    full, full_caches = run(None)
    assert full.shape[0] == 22
    for chosen in ([0, 2], [1], []):
        hidden, caches = run(torch.tensor(chosen, dtype=torch.int64))
        assert hidden.shape == (len(chosen), full.shape[1])
        if chosen:
            expected = model.compute_logits(full[batch.logits_indices[chosen]])
            bound = partial(model_bound, model.config, 7 + 9)  # sequence 0: 7 cached tokens and 9 new
            assert_paths_agree(model.compute_logits(hidden), expected, bound, "sampled rows' logits")
        for got, want in zip(caches, full_caches):
            torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert not torch.equal(full_caches[-1], before[-1])  # the step did write the recurrent states


def test_sampled_rows_only(tiny_checkpoint):
    cfg = ModelConfig.from_pretrained(tiny_checkpoint)
    assert cfg.layer_types[-1] == "full_attention"
    _check_sampled_rows(_model(cfg, tiny_checkpoint), cfg.vocab_size)


def test_sampled_rows_only_after_a_gdn_last_layer(ckpt_qwen3_5):
    cfg = ModelConfig.from_pretrained(ckpt_qwen3_5)
    cfg = dataclasses.replace(cfg, layer_types=tuple(cfg.layer_types[:-1]) + ("linear_attention",))
    _check_sampled_rows(_model(cfg), cfg.vocab_size)
