"""The GEMV probe's table file: measured shapes merge into an existing table, which the kernel module reads."""

import json
import re

import pytest

from benchmarks.gemv_probe import write_table
from deltaserve.ops.linear import cuda as linear_cuda


def test_measured_shapes_merge_into_the_table(tmp_path, monkeypatch):
    path = tmp_path / "configs.json"
    write_table(str(path), {"silu_mul:8:16": [8, 1024, 4, 1], "none:8:16": None})
    write_table(str(path), {"silu_mul:8:16": [16, 256, 4, 1], "rms_norm:32:8": [4, 512, 4, 1]})
    assert json.loads(path.read_text()) == {"none:8:16": None, "rms_norm:32:8": [4, 512, 4, 1],
                                            "silu_mul:8:16": [16, 256, 4, 1]}
    monkeypatch.setenv("DELTASERVE_GEMV_CONFIGS", str(path))
    linear_cuda._tuned_configs.cache_clear()
    try:
        assert linear_cuda.config_for("silu_mul", 8, 16) == (16, 256, 4, 1)
        assert linear_cuda.config_for("none", 8, 16) is None  # measured slower: unfused
        assert linear_cuda.config_for("gated_norm", 8, 16) is None  # not measured: unfused
    finally:
        linear_cuda._tuned_configs.cache_clear()


def test_the_packaged_table_is_well_formed():
    table = json.loads(linear_cuda.CONFIGS_FILE.read_text())
    for key, config in table.items():
        prologue, n, k = key.split(":")
        assert prologue in ("rms_norm", "silu_mul", "gated_norm", "none") and int(n) > 0 and int(k) > 0
        assert config is None or (len(config) == 4 and all(isinstance(v, int) and v > 0 for v in config))


@pytest.mark.parametrize("content, message", [
    (None, "no such file"), ("{not json", "not JSON"), ('{"silu_mul:8:16": [8, 0, 4, 1]}', "entry 'silu_mul:8:16'"),
    ('{"silu_mul": [8, 8, 4, 1]}', "entry 'silu_mul'"), ("[1, 2]", "must be a JSON object")])
def test_a_bad_table_named_by_the_environment_is_refused_by_name(tmp_path, monkeypatch, content, message):
    path = tmp_path / "table.json"
    if content is not None:
        path.write_text(content)
    monkeypatch.setenv("DELTASERVE_GEMV_CONFIGS", str(path))
    linear_cuda._tuned_configs.cache_clear()
    try:
        with pytest.raises(ValueError, match=f"DELTASERVE_GEMV_CONFIGS=.*{re.escape(message)}"):
            linear_cuda.config_for("silu_mul", 8, 16)
    finally:
        linear_cuda._tuned_configs.cache_clear()


def test_a_moe_model_probes_its_router_in_the_norm_launch():
    """35B-A3B has no dense MLP: its decode projections are GDN's and attention's, and the joined router (256
    experts + the shared gate, padded to 272 rows) after the norm that writes its row too ("rms_norm_and", tabled
    under the "rms_norm" prologue that ops/linear reads)."""
    from benchmarks.gemv_probe import decode_projections
    from deltaserve.config import ModelConfig
    from deltaserve.model_configs import CONFIGS_DIR

    shapes = decode_projections(ModelConfig.from_pretrained(str(CONFIGS_DIR / "qwen3.5-35b-a3b")))
    assert ("rms_norm_and", 272, 2048) in shapes and all(n > 0 and k > 0 for _, n, k in shapes)
    assert not any(prologue == "silu_mul" for prologue, _, _ in shapes)


def test_batch_projections_name_the_shared_experts_weights_as_the_block_multiplies_them():
    """Above one token a bf16 MoE layer multiplies its whole joined weight (router, shared gate, shared gate/up,
    each block padded) and then the shared down-projection: batch_projections must name those exact shapes, or the
    skinny table's entries would never be read."""
    import dataclasses

    from benchmarks.gemv_probe import batch_projections, decode_projections
    from deltaserve.config import ModelConfig
    from deltaserve.layers.mlp import SparseMoE
    from deltaserve.model_configs import CONFIGS_DIR

    cfg = dataclasses.replace(ModelConfig.from_pretrained(str(CONFIGS_DIR / "qwen3.5-35b-a3b")), num_experts=5,
                              hidden_size=32, shared_expert_intermediate_size=12)
    block = SparseMoE(32, 5, 2, 8, 12, norm_topk_prob=True)
    block.fuse()
    shared_shapes = batch_projections(cfg)[len(decode_projections(cfg)):]
    down = block.shared_expert.down_proj.weight
    assert shared_shapes == [("rms_norm", *block.in_weight.shape), ("silu_mul", *down.shape)]
