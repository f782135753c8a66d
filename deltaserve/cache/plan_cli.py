"""The memory plan as text: the block the engine logs at startup, and `deltaserve plan`.

    deltaserve plan MODEL_OR_CONFIG [engine flags] [--gpu NAME | --gpu-memory BYTES] [--quantization METHOD]
                    [--tensor-parallel-size N] [--pipeline-parallel-size M]

MODEL_OR_CONFIG is a checkpoint directory, a config.json, or a hub id (a copy in the local Hugging Face
cache, else the published config shipped in deltaserve/model_configs): nothing else is read (no weights, no
GPU, no download), so "does Qwen3.5-27B fit on a 32 GB card at 262K context with fp8 KV, and how many requests
run at once?" is answered before anything is fetched. A quantized checkpoint's weights are counted in its format
(its config's quantization_config or hf_quant_config.json; `--quantization fp8` plans a bf16 one quantized at
load), as `deltaserve serve` would load them. The engine flags are `deltaserve serve`'s; serve
flags that do not change memory are accepted and listed as ignored. Exit status: 0 when the plan for the
chosen device fits (or no device was chosen), 1 when it does not, 2 for bad input.

With --tensor-parallel-size / --pipeline-parallel-size the plan is per rank (one device each): every rank of a
stage holds the same share, so one plan per pipeline stage is printed, and the GPU table shows the tightest stage
(every stage holds the same requests' KV and states, so the smallest pool bounds them all).
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from deltaserve.cache.planner import MemoryPlan, plan
from deltaserve.config import (DTYPES, KV_CACHE_DTYPES, PERFORMANCE_MODES, QUANTIZATION_FLAGS, SSM_CACHE_DTYPES,
                               ConfigError, EngineConfig, ModelConfig)
from deltaserve.layers.quant import detect_weight_format
from deltaserve.model_configs import resolve_model
from deltaserve.parallel_layout import RankLayout


@dataclass(frozen=True)
class Gpu:
    name: str
    marketed: str  # the size on the box
    memory_bytes: int  # total memory as the CUDA driver reports it (less than marketed: the driver keeps some)


def _gib(value: float) -> int:
    return round(value * 1024) * 2**20  # whole MiB, as nvidia-smi counts


def _gpu_key(name: str) -> str:
    """"RTX 5090", "rtx-5090" and "rtx5090" name the same card."""
    return name.lower().replace(" ", "").replace("-", "").replace("_", "")


# Totals as torch.cuda.mem_get_info() reports them on common cards (rounded to 0.01 GiB; ECC and driver
# versions move them slightly). For an exact plan pass --gpu-memory with your card's figure.
GPUS = {_gpu_key(gpu.name): gpu for gpu in (
    Gpu("RTX 3090", "24 GB", _gib(23.69)),
    Gpu("RTX 4090", "24 GB", _gib(23.65)),
    Gpu("RTX 5090", "32 GB", _gib(31.36)),
    Gpu("L4", "24 GB", _gib(22.05)),
    Gpu("L40S", "48 GB", _gib(44.39)),
    Gpu("A100-40GB", "40 GB", _gib(39.39)),
    Gpu("A100-80GB", "80 GB", _gib(79.15)),
    Gpu("H100", "80 GB", _gib(79.11)),
    Gpu("H200", "141 GB", _gib(139.81)),
    Gpu("B200", "180 GB", _gib(178.35)),
)}

_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40}


def parse_bytes(text: str, what: str = "bytes") -> int:
    """A byte count: 34359738368, 9.15e9, 32G / 32GiB (binary), 32g / 32GB (decimal), as vLLM's k/K rule."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?(?:[eE]\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = None
    if match is not None:  # one-letter units are case-sensitive (k = 1000, K = 1024), longer ones are not
        unit = match.group(2) if len(match.group(2)) <= 1 else match.group(2).lower()
    if unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"expected a number of {what} such as 34359738368, 9.15e9, 32GiB or "
                                         f"32GB, got {text!r}")
    value = float(match.group(1)) * _UNITS[unit]
    if value != int(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number of {what}")
    return int(value)


def parse_model_len(text: str) -> int | None:
    """--max-model-len: tokens (262144, 256K, 128k) or auto / -1 (None: the longest that fits)."""
    if text.strip().lower() in ("auto", "-1"):
        return None
    return parse_bytes(text, "tokens")


def find_gpu(name: str) -> Gpu:
    gpu = GPUS.get(_gpu_key(name))
    if gpu is None:
        known = ", ".join(g.name for g in GPUS.values())
        raise argparse.ArgumentTypeError(f"unknown GPU {name!r}; known: {known} (or give --gpu-memory BYTES)")
    return gpu


def _size(num_bytes: int) -> str:
    """146.8 MiB, or 41.0 KiB for the tiny models."""
    return f"{num_bytes / 2**20:.1f} MiB" if num_bytes >= 2**20 else f"{num_bytes / 2**10:.1f} KiB"


def _count(num: int) -> str:
    return f"{num / 1e9:.2f}B" if num >= 1e9 else f"{num / 1e6:.2f}M"


def describe_plan(p: MemoryPlan) -> str:
    """The plan as one readable block: a table of where the bytes go, then what it allows."""
    on = f" on {p.device_name}" if p.device_name else ""
    if p.budget_bytes is not None:
        budget = f"{p.device_memory_bytes:,} bytes x {p.gpu_memory_utilization} = {p.budget_bytes:,} bytes"
    else:
        budget = f"cache memory {p.cache_memory_bytes:,} bytes from {p.cache_memory_source}"
    lines = [f"Memory plan for {p.model_name}{on} ({budget})"]
    if p.rank is not None:
        lines.append(f"  per rank: {p.rank}")
    lines.append(f"  {'part':<20}{'bytes':>18}{'GiB':>9}  detail")

    def row(label: str, nbytes: int, detail: str = "") -> None:
        lines.append(f"  {label:<20}{nbytes:>18,}{nbytes / 2**30:>9.2f}  {detail}".rstrip())

    formats = " + ".join(f"{name} {nbytes:,} B" for name, nbytes in p.weight_bytes_by_format.items() if nbytes)
    quantized = f" ({p.weight_format})" if p.weight_format else ""
    row("weights", p.weight_bytes, f"{_count(p.num_parameters)} parameters: {formats}{quantized}")
    if p.quant_scratch_bytes:
        row("quant GEMM scratch", p.quant_scratch_bytes, f"a {p.model_dtype} copy of the largest int4 / NVFP4 matrix, "
            "for prefill through cuBLAS")
    if p.cache_memory_source != "CPU default":
        how = "measured" if p.activation_measured else "estimated"
        row("activations", p.activation_bytes, f"{how}: {p.max_num_batched_tokens:,} batched tokens, "
            f"up to {min(p.max_num_seqs, p.max_num_batched_tokens)} rows sampled")
        row("CUDA graphs", p.cuda_graph_bytes, f"estimated: {p.num_cuda_graphs} decode and chunk graphs, "
            f"batches up to {p.max_num_seqs}" if p.num_cuda_graphs else "none (--enforce-eager)")
        row("runtime overhead", p.overhead_bytes,
            "measured" if p.overhead_measured else "estimated: CUDA context, library workspaces")
    slot = _size(p.state_bytes_per_slot)
    row("GDN working states", p.num_working_slots * p.state_bytes_per_slot, f"{p.num_working_slots} slots "
        f"(max_num_seqs {p.max_num_seqs} + 1 dummy) x {slot} ({p.conv_state_dtype} conv, "
        f"{p.ssm_state_dtype} recurrent)")
    row("GDN checkpoints", p.num_checkpoint_slots * p.state_bytes_per_slot,
        f"{p.num_checkpoint_slots} prefix-cache slots x {slot}")
    kv_bytes = p.num_blocks * p.kv_bytes_per_block
    row("KV cache", kv_bytes, f"{p.num_blocks:,} blocks (1 null) x {p.block_size} tokens x "
        f"{p.kv_bytes_per_token:,} B/token ({p.kv_cache_dtype})")
    used = p.num_state_slots * p.state_bytes_per_slot + kv_bytes + (p.fixed_bytes if p.budget_bytes else 0)
    total = p.budget_bytes if p.budget_bytes is not None else p.cache_memory_bytes
    if total >= used:
        row("unused", total - used, "less than one KV block, or more than the sequences can use")
    row("total", max(total, used))
    lines.append(f"  KV per token: {p.kv_formula}")
    lines.append(f"  GDN state per sequence: {p.state_formula}")
    asked = f" (asked {p.requested_max_num_seqs})" if p.max_num_seqs != p.requested_max_num_seqs else ""
    lines.append(f"  => max_model_len {p.max_model_len:,} (model limit {p.model_max_len:,}); KV pool "
                 f"{p.pool_tokens:,} tokens; max_num_seqs {p.max_num_seqs}{asked}; full-length requests at once: "
                 f"{p.full_length_requests}")
    if 0 < p.max_num_seqs <= p.pool_tokens:  # the two pools' split, as requests at once by their length
        share = p.pool_tokens // p.max_num_seqs
        lines.append(f"  requests at once: {p.max_num_seqs} of up to {share:,} tokens each (the state slots), "
                     f"{p.full_length_requests} of {p.max_model_len:,} (the KV pool)")
    lines += [f"  note: {note}" for note in p.notes]
    if p.error is not None:
        lines.append(f"  DOES NOT FIT: {p.error}")
    return "\n".join(lines)


def gpu_table(plans: list[tuple[Gpu, MemoryPlan]]) -> str:
    """One line per GPU: does it fit, and what context and concurrency it allows."""
    header = (f"  {'GPU':<11}{'sold as':>8}{'memory assumed (B)':>20}  {'fits':<5}{'max_num_seqs':>13}"
              f"{'max_model_len':>14}{'KV pool tokens':>15}{'full-length reqs':>17}")
    lines = [header]
    for gpu, p in plans:
        figures = (f"{p.max_num_seqs:>13}{p.max_model_len:>14,}{p.pool_tokens:>15,}{p.full_length_requests:>17}"
                   if p.error is None else f"  {_short_reason(p)}")
        fits = "yes" if p.error is None else "no"
        lines.append(f"  {gpu.name:<11}{gpu.marketed:>8}{gpu.memory_bytes:>20,}  {fits:<5}{figures}")
    return "\n".join(lines)


def _short_reason(p: MemoryPlan) -> str:
    """Why a plan for a device does not fit, in a table cell."""
    cache_flag = p.budget_bytes is None  # --kv-cache-memory-bytes sizes the cache: it all must fit the device
    limit = p.device_memory_bytes if cache_flag else p.budget_bytes
    needed = p.fixed_bytes + (p.cache_memory_bytes if cache_flag else 0)
    if p.weight_bytes > limit:
        return f"the weights alone ({p.weight_bytes / 2**30:.1f} GiB) exceed the {limit / 2**30:.1f} GiB usable"
    if needed > limit:
        return (f"weights, activations, graphs, runtime{' and cache' if cache_flag else ''} need "
                f"{needed / 2**30:.1f} GiB of {limit / 2**30:.1f} GiB")
    if p.pool_tokens < p.max_model_len:
        return f"the KV pool holds {p.pool_tokens:,} tokens, less than --max-model-len {p.max_model_len:,}"
    return p.error.split(":")[0]


def add_plan_args(parser: argparse.ArgumentParser) -> None:
    """The flags of `deltaserve plan` (the engine flags keep `deltaserve serve`'s names and defaults)."""
    parser.add_argument("model", metavar="MODEL_OR_CONFIG",
                        help="checkpoint directory, config.json, or hub id (e.g. Qwen/Qwen3.5-27B: its shipped config)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--gpu", type=find_gpu, default=None, help=f"plan for one of: "
                       f"{', '.join(g.name for g in GPUS.values())}")
    where.add_argument("--gpu-memory", type=parse_bytes, default=None, metavar="BYTES",
                       help="plan for a device with this much total memory (e.g. 34190917632 or 31.84GiB)")
    parser.add_argument("-q", "--quantization", choices=tuple(QUANTIZATION_FLAGS), default=None,
                        help="as `deltaserve serve --quantization`: the checkpoint's own format is read from its "
                             "config; fp8 on a bf16 checkpoint plans it quantized at load")
    parser.add_argument("--dtype", choices=DTYPES, default="auto")
    parser.add_argument("--max-model-len", type=parse_model_len, default=None, help="tokens, or auto (default)")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=lambda text: parse_bytes(text, "tokens"), default=None,
                        help="default 8192, 16384 with --performance-mode throughput")
    parser.add_argument("--performance-mode", choices=PERFORMANCE_MODES, default="balanced")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--kv-cache-memory-bytes", type=parse_bytes, default=None)
    parser.add_argument("--num-gpu-blocks-override", type=int, default=None)
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto")
    parser.add_argument("--mamba-ssm-cache-dtype", choices=SSM_CACHE_DTYPES, default="auto")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--prefix-cache-state-slots", type=int, default=None)
    parser.add_argument("-tp", "--tensor-parallel-size", type=_positive, default=1,
                        help="plan one rank of this many tensor-parallel GPUs")
    parser.add_argument("-pp", "--pipeline-parallel-size", type=_positive, default=1,
                        help="plan each of this many pipeline stages (one rank each)")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}")
    return value


def tightest_plan(plans: list[MemoryPlan]) -> MemoryPlan:
    """The stage that bounds the rest: one that does not fit, else the one with the smallest KV pool."""
    return min(plans, key=lambda p: (p.error is None, p.pool_tokens, p.max_num_seqs))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deltaserve plan", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_plan_args(parser)
    args, ignored = parser.parse_known_args(argv)
    try:
        source = resolve_model(args.model, need_weights=False)
        cfg = ModelConfig.from_pretrained(source)
        engine = EngineConfig(
            model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
            gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
            num_gpu_blocks_override=args.num_gpu_blocks_override, kv_cache_dtype=args.kv_cache_dtype,
            mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype, enforce_eager=args.enforce_eager,
            enable_prefix_caching=args.enable_prefix_caching, prefix_cache_state_slots=args.prefix_cache_state_slots,
            performance_mode=args.performance_mode)
        name = _model_name(args.model, source)
        common = dict(weight_format=detect_weight_format(source, args.quantization), model_name=name)
        tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
        ranks = [RankLayout(tp_size=tp, pp_rank=stage, pp_size=pp) for stage in range(pp)]

        def stages(**where) -> list[MemoryPlan]:
            return [plan(cfg, engine, parallel=rank, **where, **common) for rank in ranks]

        table = [(gpu, tightest_plan(stages(device_memory_bytes=gpu.memory_bytes, device_name=gpu.name)))
                 for gpu in GPUS.values()]
        chosen = None
        if args.gpu is not None:
            chosen = stages(device_memory_bytes=args.gpu.memory_bytes, device_name=args.gpu.name)
        elif args.gpu_memory is not None or args.kv_cache_memory_bytes is not None:
            chosen = stages(device_memory_bytes=args.gpu_memory)
    except (ConfigError, ValueError) as exc:
        parser.exit(2, f"deltaserve plan: error: {exc}\n")
    out = []
    if ignored:
        out.append(f"ignored (they do not change the memory plan): {' '.join(ignored)}")
    if chosen is not None:
        for stage in chosen:
            out += [describe_plan(stage), ""]
    else:
        facts = table[0][1]
        out += [f"{name}: {_count(facts.num_parameters)} parameters, {facts.weight_bytes / 2**30:.2f} GiB of weights",
                f"  KV per token: {facts.kv_formula}", f"  GDN state per sequence: {facts.state_formula}", ""]
    out += ["Common GPUs, with the same flags (memory assumed: the total the CUDA driver reports):", gpu_table(table)]
    print("\n".join(out))
    return 0 if chosen is None or all(stage.error is None for stage in chosen) else 1


def _model_name(model: str, source: Path) -> str:
    """The hub id's name (Qwen3.5-27B for Qwen/Qwen3.5-27B), else the checkpoint folder's."""
    if not Path(model).exists():
        return model.split("/")[-1]
    return (source.parent if source.name == "config.json" else source).resolve().name


if __name__ == "__main__":
    sys.exit(main())
