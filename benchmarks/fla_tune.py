"""Autotune fla-core's kernels for a model's shapes on this GPU and pin the choices (ops/gdn/fla_configs.py).

    python -m benchmarks.fla_tune CONFIG_DIR [CONFIG_DIR ...] [--out deltaserve/ops/gdn/fla_configs]

Starts the engine on each model (dummy weights): its warm-up runs the chunked gated delta rule at the shapes
serving meets, and fla autotunes each kernel there. The choices are then written, one JSON file per kernel,
under OUT/<GPU> (merged with what is there), where the engine finds them at its next start.
"""

from __future__ import annotations

import argparse
import gc
import os
import time
from pathlib import Path

import torch

from deltaserve.ops.gdn import fla_configs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fla_tune", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+", help="checkpoint or config.json directories")
    parser.add_argument("--out", type=Path, default=fla_configs.CONFIG_ROOT, help="root of the per-GPU folders")
    parser.add_argument("--max-model-len", type=int, default=32768)
    args = parser.parse_args(argv)
    os.environ["FLA_CACHE_MODE"] = "disabled"  # autotune everything here, whatever is pinned already
    from deltaserve.config import EngineConfig
    from deltaserve.engine.llm_engine import LLMEngine

    for model in args.models:
        start = time.perf_counter()
        engine = LLMEngine(EngineConfig(model=model, load_format="dummy", skip_tokenizer_init=True,
                                        max_model_len=args.max_model_len))
        print(f"{model}: engine ready in {time.perf_counter() - start:.1f} s", flush=True)
        del engine
        gc.collect()
        torch.cuda.empty_cache()  # the next model plans its memory from what is free
    folder = fla_configs.gpu_folder(args.out)
    written = fla_configs.dump_autotuned(folder)
    print(f"wrote {len(written)} kernel configurations to {folder}: {', '.join(written)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
