"""Pinned fla-core kernel configurations (ops/gdn/fla_configs.py): what dump_autotuned writes, fla's own loader
reads back, and use_pinned_configs points fla at a GPU's folder unless the user chose otherwise. Needs fla-core
(installed on the GPU machine; its config loader is plain Python)."""

import json
import os
import sys
import types

import pytest

fla_cache = pytest.importorskip("fla.ops.utils.cache")
triton = pytest.importorskip("triton")

from deltaserve.ops.gdn import fla_configs  # noqa: E402


@triton.jit
def _probe_kernel(x, N: triton.language.constexpr, BV: triton.language.constexpr):
    pass


def test_dump_then_fla_loads_the_choice(tmp_path, monkeypatch):
    configs = [triton.Config({"BV": bv}, num_warps=w, num_stages=2) for bv in (16, 32) for w in (2, 4)]
    tuner = fla_cache.CachedAutotuner(_probe_kernel, _probe_kernel.arg_names, configs, ["N"], None, None)
    key = (128, "torch.bfloat16")
    tuner.cache[key] = configs[3]  # what autotuning would have chosen
    wrapped = triton.heuristics({"BV": lambda args: 16})(tuner)  # how fla decorates most of its kernels
    monkeypatch.setitem(sys.modules, "fla._probe", types.SimpleNamespace(kernel=wrapped))  # where dump looks
    assert "_probe_kernel" in fla_configs.dump_autotuned(tmp_path)  # with any fla kernel this process has run
    assert "_probe_kernel" in fla_configs.dump_autotuned(tmp_path)
    assert len(json.loads((tmp_path / "_probe_kernel.json").read_text())["autotune_entries"]) == 1  # merged
    monkeypatch.setenv("FLA_CONFIG_DIR", str(tmp_path))
    monkeypatch.setattr(fla_cache, "FLA_CACHE_MODE", fla_cache.FlaCacheMode.FUZZY)
    loaded = fla_cache.load_cached_config("_probe_kernel", fla_cache.AutotuneKey(key))
    assert loaded["kwargs"] == {"BV": 32} and loaded["num_warps"] == 4 and loaded["num_stages"] == 2
    # another sequence length: the same numeric structure matches fuzzily; another dtype does not
    assert fla_cache.load_cached_config("_probe_kernel", fla_cache.AutotuneKey((4096, "torch.bfloat16"))) == loaded
    assert fla_cache.load_cached_config("_probe_kernel", fla_cache.AutotuneKey((128, "torch.float16"))) is None


def test_use_pinned_configs_only_with_files_and_without_user_settings(tmp_path, monkeypatch):
    monkeypatch.delenv("FLA_CONFIG_DIR", raising=False)
    monkeypatch.delenv("FLA_CACHE_MODE", raising=False)
    monkeypatch.setattr(fla_cache, "FLA_CACHE_MODE", fla_cache.FlaCacheMode.DISABLED)
    assert not fla_configs.use_pinned_configs(tmp_path)  # no folder for this GPU
    folder = fla_configs.gpu_folder(tmp_path)
    folder.mkdir(parents=True)
    (folder / "some_kernel.json").write_text("{}")
    monkeypatch.setenv("FLA_CACHE_MODE", "disabled")
    assert not fla_configs.use_pinned_configs(tmp_path)  # the user's choice stands
    monkeypatch.delenv("FLA_CACHE_MODE")
    assert fla_configs.use_pinned_configs(tmp_path)
    assert fla_cache.FLA_CACHE_MODE is fla_cache.FlaCacheMode.FUZZY
    assert os.environ["FLA_CONFIG_DIR"] == str(folder)  # both variables are restored by monkeypatch after the test
