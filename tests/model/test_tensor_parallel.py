"""Tensor parallelism on the CPU: two gloo processes each load their slice of a tiny float32 checkpoint and run
it; rank 0's logits must match the tp_size 1 model's, and greedy decoding must pick the same tokens.

One spawn serves every architecture (dense and MoE Qwen3.5, the tied variant, Qwen3-Next with one KV head, so
that both ranks hold a replica of it). Steps: a batched chunked prefill (two sequences, the second chunk after a
cached prefix), then greedy decode steps.

Bound: the two runs differ only in the order of float32 sums: each row-parallel projection adds two partial sums
instead of one running sum, and the embedding and logits are exact. A dot product of length n computed in two
orders differs by at most 2 n eps sum|a_i b_i|; we bound sum|a_i b_i| by the logit scale and let each of the
model's 2 * num_layers reduced blocks contribute once (the tiny models' activations are O(1)), giving
|delta logit| <= 2 * num_blocks * n_max * eps * max|logit|. A wrong slice of any weight is off by O(max|logit|).
"""

import pytest
import torch

from deltaserve.config import ConfigError, ModelConfig
from deltaserve.demo import build_checkpoint
from deltaserve.layers.quant.scheme import WeightFormat
from deltaserve.model.loader import load_model
from deltaserve.worker.distributed import ParallelContext
from tests.model.tp_harness import assert_within_reordered_sums, serve_sharded_and_single

# (arch, config overrides): every head count divides by 2, except Qwen3-Next's single KV head (replicated)
VARIANTS = {"qwen3_5": None, "qwen3_5_tied": None, "qwen3_5_moe": None,
            "qwen3_next": {"num_key_value_heads": 1}}
PREFILL = [{1: 5, 2: 7}, {1: 6, 2: 3}]  # {state slot: tokens} of each batched step: two sequences
DECODE_STEPS = 4


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    checkpoints = {name: str(build_checkpoint(root / name, name, config_overrides=overrides))
                   for name, overrides in VARIANTS.items()}
    return serve_sharded_and_single(root, checkpoints, PREFILL, DECODE_STEPS)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_rank0_logits_match_single_rank(results, name):
    (sharded, _), (single, _), cfg = results[name]
    assert_within_reordered_sums(sharded, single, cfg.num_layers, max(cfg.hidden_size, cfg.intermediate_size), name)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_greedy_tokens_identical(results, name):
    (_, sharded_tokens), (_, single_tokens), _ = results[name]
    assert sharded_tokens == single_tokens


def test_kv_heads_replicate_when_ranks_exceed_them():
    # 4 ranks over 2 KV heads: ranks 0, 1 hold head 0 and ranks 2, 3 head 1 (their query heads read it)
    assert [ParallelContext(tp_rank=r, tp_size=4).kv_head_shard(2) for r in range(4)] == [(0, 1), (0, 1), (1, 1),
                                                                                            (1, 1)]
    assert ParallelContext(tp_rank=1, tp_size=2).kv_head_shard(4) == (2, 2)
    with pytest.raises(ValueError, match="num_key_value_heads = 3"):
        ParallelContext(tp_size=4).kv_head_shard(3)


@pytest.mark.parametrize("tp_size, field", [(3, "vocab_size = 1024"), (8, "linear_num_key_heads = 2")])
def test_an_indivisible_size_names_its_field(ckpt_qwen3_5, tp_size, field):
    cfg = ModelConfig.from_pretrained(ckpt_qwen3_5)
    with pytest.raises(ValueError, match=field):
        load_model(None, cfg, torch.float32, "meta", load_format="dummy", parallel=ParallelContext(tp_size=tp_size))


class _UnslicedFormat(WeightFormat):
    """A format that does not say tensor_parallel (every format the engine reads today does)."""

    method, description = "unsliced", "a format without per-rank slicing"

    def scheme_for(self, name):
        return None


def test_formats_without_rank_slicing_are_refused_under_tp(ckpt_qwen3_5):
    cfg = ModelConfig.from_pretrained(ckpt_qwen3_5)
    with pytest.raises(ConfigError, match="--tensor-parallel-size 2 does not support unsliced checkpoints"):
        load_model(None, cfg, torch.float32, "meta", load_format="dummy", weight_format=_UnslicedFormat(),
                   parallel=ParallelContext(tp_size=2))
