"""Where start-up memory goes on the GPU: torch's reserved and allocated bytes and the device's in-use bytes
after each start-up stage (weights and plan, caches bound, graphs captured, warm-up), against the plan's budget.

    python -m benchmarks.startup_memory_probe deltaserve/model_configs/qwen3.5-27b-nvfp4 \
        --gpu-memory-utilization 0.211 --max-model-len 200000 --kv-cache-dtype fp8

(`tests/gpu/run.sh OUT memory` runs it at the users' 32 GB-card share of the GPU it finds.)
Run it with and without PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to see the allocator's part.
"""

import argparse
import functools

import torch

from deltaserve.engine.llm_engine import LLMEngine
from deltaserve.worker import cuda_graph, setup


def report(stage: str) -> None:
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    gib = 2**30
    print(f"{stage:<22} in use {(total - free) / gib:7.2f} GiB  reserved {torch.cuda.memory_reserved() / gib:7.2f}"
          f"  allocated {torch.cuda.memory_allocated() / gib:7.2f}"
          f"  peak {torch.cuda.max_memory_allocated() / gib:7.2f}", flush=True)


def around(owner, name: str, before: str | None, after: str) -> None:
    """Wrap owner.name so that the figures are printed before (if named) and after each call."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapped(*args, **kwargs):
        if before:
            report(before)
        result = original(*args, **kwargs)
        report(after)
        return result

    setattr(owner, name, wrapped)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--max-num-seqs", type=int, default=128)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("no CUDA device here: the probe measures GPU memory")

    from deltaserve import LLM

    around(setup.EngineSetup, "_plan", "weights loaded", "planned")
    around(cuda_graph.StepGraphs, "capture", "caches bound", "graphs captured")
    around(LLMEngine, "warm_up", None, "warmed up")
    llm = LLM(args.model, load_format="dummy", dtype="bfloat16", gpu_memory_utilization=args.gpu_memory_utilization,
              max_model_len=args.max_model_len, kv_cache_dtype=args.kv_cache_dtype, max_num_seqs=args.max_num_seqs,
              enable_prefix_caching=True, skip_tokenizer_init=True)
    plan = llm.engine.memory_plan
    print(f"budget {plan.budget_bytes / 2**30:.2f} GiB; planned: overhead {plan.overhead_bytes / 2**30:.2f}, "
          f"activations {plan.activation_bytes / 2**30:.2f}, graphs {plan.cuda_graph_bytes / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
