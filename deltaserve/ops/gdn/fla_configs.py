"""fla-core's kernel configurations pinned per GPU model, so that a cold start does not autotune them.

fla's chunked gated delta rule autotunes its kernels at their first call: without Triton's disk cache that
compiles dozens of variants and takes about half of the engine's start (docs/performance.md, 'Start-up'). fla
can read the chosen configurations instead, one `{kernel}.json` per kernel in FLA_CONFIG_DIR, when
FLA_CACHE_MODE allows it (fla/ops/utils/cache.py). This module keeps such files under `fla_configs/<GPU>/`
beside it (the GPU's name as fla writes it, e.g. `NVIDIA_H200`) and

    use_pinned_configs()     points fla at the folder of this GPU, if there is one, before its first call
                             (FLA_CACHE_MODE "fuzzy": a shape not in the files is autotuned as before);
                             a user's own FLA_CONFIG_DIR or FLA_CACHE_MODE wins
    dump_autotuned(folder)   writes what fla's autotuners chose in this process into folder, merged with the
                             files there (`python -m benchmarks.fla_tune` runs a model and calls it)
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

CONFIG_ROOT = Path(__file__).with_name("fla_configs")


def gpu_folder(root: Path = CONFIG_ROOT) -> Path:
    """The folder of this process's GPU under root (fla's name for the GPU)."""
    from fla.ops.utils.cache import get_gpu_info  # optional dependency, GPU only

    return root / get_gpu_info()


def use_pinned_configs(root: Path = CONFIG_ROOT) -> bool:
    """Point fla at the pinned configurations of this GPU, if root holds them and the user has not chosen
    FLA_CONFIG_DIR or FLA_CACHE_MODE. Returns whether it did."""
    if "FLA_CONFIG_DIR" in os.environ or "FLA_CACHE_MODE" in os.environ or not any(root.glob("*/*.json")):
        return False
    try:
        from fla.ops.utils import cache  # fla-core >= 0.5; an older one autotunes as before
    except ImportError:
        return False
    folder = gpu_folder(root)
    if not any(folder.glob("*.json")):
        return False

    os.environ["FLA_CONFIG_DIR"] = str(folder)
    os.environ["FLA_CACHE_MODE"] = cache.FlaCacheMode.FUZZY.value
    cache.FLA_CACHE_MODE = cache.FlaCacheMode.FUZZY  # fla reads the variable once, at its import
    logger.info("fla-core reads its kernel configurations from %s (no autotuning for the shapes there)", folder)
    return True


def _autotuners() -> list:
    """fla's autotuned kernels loaded in this process: module attributes of fla.*, or inside one (most of fla's
    kernels are `@triton.heuristics` over `@autotune`, so the module holds a Heuristics whose .fn is the tuner)."""
    from triton.runtime.autotuner import Autotuner

    found = {}
    for name, module in list(sys.modules.items()):
        if name == "fla" or name.startswith("fla."):
            for value in vars(module).values():
                while value is not None and not isinstance(value, Autotuner) and hasattr(value, "arg_names"):
                    value = getattr(value, "fn", None)  # Heuristics -> Autotuner -> JITFunction -> function
                if isinstance(value, Autotuner):
                    found[id(value)] = value
    return list(found.values())


def _kernel_name(autotuner) -> str:
    fn = autotuner.fn
    return getattr(fn, "fn", fn).__name__


def dump_autotuned(folder: Path) -> list[str]:
    """Write the configurations fla's autotuners chose in this process into folder/{kernel}.json (fla's format:
    entries keyed by the hash of the autotune key), keeping the entries already there. Returns the kernels
    written."""
    import triton
    from fla.ops.utils.cache import AutotuneKey

    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for autotuner in _autotuners():
        if not autotuner.cache:
            continue
        name = _kernel_name(autotuner)
        path = folder / f"{name}.json"
        data = json.loads(path.read_text()) if path.exists() else {"kernel_name": name, "autotune_entries": {}}
        for key, config in autotuner.cache.items():
            entry = {"num_warps": config.num_warps, "num_stages": config.num_stages, "num_ctas": config.num_ctas,
                     "maxnreg": config.maxnreg, "kwargs": dict(config.kwargs)}
            data["autotune_entries"][AutotuneKey.key_hash(key)] = {
                "autotune_key": AutotuneKey.normalize_autotune_key(key), "config": entry}
        data["triton_version"] = triton.__version__
        path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        written.append(name)
    return sorted(written)
