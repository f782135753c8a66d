"""Fixtures of the model tests: the float32 tiny sources that the quantized checkpoints are made from."""

import pytest

from tests.model.quant_checkpoints import tiny_source


@pytest.fixture(scope="session")
def quant_sources(tmp_path_factory):
    """arch -> a tiny checkpoint of QUANT_SHAPES (matrix gain 0.5), for qwen3_5 and qwen3_5_moe."""
    root = tmp_path_factory.mktemp("quant-src")
    return {arch: tiny_source(root / arch, arch, matrix_gain=0.5) for arch in ("qwen3_5", "qwen3_5_moe")}
