"""Offline engine benchmarks (the W-workloads of WORKLOADS.md through the engine API, no HTTP).

    python -m benchmarks.offline MODEL_OR_CONFIG_DIR --workloads W1,W3 [--load-format dummy] [--out FILE]

Each result is printed beside its physical limit: decode step time >= bytes read per step / HBM bandwidth;
prefill time >= FLOPs / matmul rate. Bandwidth and matmul rate are measured on the device at start; the matmul
rate is that of ten back-to-back products (~790 TFLOP/s on an H200, as WORKLOADS.md has it), and the TTFT limit at
the rate sustained over 3 s (~675: the power cap lowers the clock) is printed beside it. A W8A8 FP8 checkpoint's
products count at the FP8 rate, measured the same way (~1,300-1,500 TFLOP/s on an H100 / H200), the rest at bf16's.
"""

from __future__ import annotations

import argparse
import collections
import gc
import gzip
import json
import logging
import os
import shutil
import statistics
import time
import zlib

import torch

from deltaserve.config import SSM_CACHE_DTYPES, EngineConfig
from deltaserve.engine.llm_engine import LLMEngine
from deltaserve.layers.linear import QuantLinear
from deltaserve.layers.mlp import QuantExperts
from deltaserve.layers.quant.fp8 import Fp8BlockScheme
from deltaserve.layers.quant.weight import held_quantized_weights
from deltaserve.sampling import RequestOutputKind, SamplingParams

# (input tokens, output tokens, number of prompts, concurrency)
WORKLOADS = {
    "W1": [(1024, 512, 3, 1)],
    "W2": [(131072, 256, 1, 1)],
    "W3": [(8192, 1, 5, 1), (32768, 1, 3, 1)],
    "W6": [(1024, 512, 256, 64), (1024, 512, 256, 256)],
    "W7": [(8192, 1024, 64, 16)],  # MoE throughput (fixed lengths here; served W7 draws them with range 0.8)
    "W8": [(1024, 512, 3, 1)],
}
# prefix-cache workloads, run by their own functions
PREFIX_WORKLOADS = {"W4": "shared 36,864-token prefix, 16-token suffixes, 5 prompts, out 1",
                    "W5": "8-turn agent: each turn = previous prompt + answer + 2,000 new tokens, out 256"}


def measure_device() -> tuple[float, float]:
    """(copy bandwidth in bytes/s counting read + write, bf16 matmul FLOP/s) measured on this GPU."""
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        y.copy_(x)
        a @ a
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    bandwidth = 2 * x.numel() * 10 / (time.perf_counter() - t)
    t = time.perf_counter()
    for _ in range(10):
        a @ a
    torch.cuda.synchronize()
    flops = 2 * 8192 ** 3 * 10 / (time.perf_counter() - t)
    del x, y, a
    torch.cuda.empty_cache()
    return bandwidth, flops


def measure_fp8_matmul() -> float | None:
    """FP8 (e4m3, per-tensor scales) FLOP/s of ten back-to-back 8192^3 products, or None where the GPU has no FP8
    tensor cores (before sm_89)."""
    if torch.cuda.get_device_capability() < (8, 9):
        return None
    a = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn)
    b = a.t()  # column-major, as _scaled_mm takes its second operand
    one = torch.ones((), device="cuda")
    for _ in range(3):
        torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    torch.cuda.synchronize()
    flops = 2 * 8192 ** 3 * 10 / (time.perf_counter() - t)
    del a, b
    torch.cuda.empty_cache()
    return flops


def measure_sustained_matmul(seconds: float = 3.0) -> float:
    """bf16 FLOP/s of 8192^3 products run back to back for `seconds`, over the last second: what a long prefill
    gets once the board's power cap has lowered its clock (H200: ~675 TFLOP/s at ~690 W, against ~790 for the
    first ten products, docs/performance.md)."""
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    flop = 2 * 8192 ** 3
    start = time.perf_counter()
    while True:
        t, n = time.perf_counter(), 0
        while time.perf_counter() - t < 1.0:
            for _ in range(10):
                a @ a
            torch.cuda.synchronize()
            n += 10
        if time.perf_counter() - start >= seconds:
            rate = flop * n / (time.perf_counter() - t)
            del a
            torch.cuda.empty_cache()
            return rate


class Limits:
    """Physical limits of one model on one device, from the model's own parameter sizes."""

    def __init__(self, engine: LLMEngine, bandwidth: float, flops: float, fp8_flops: float | None = None):
        model = engine.runner.model
        cfg = engine.model_config
        self.bandwidth, self.flops = bandwidth, flops
        self.fp8_flops = fp8_flops or flops
        embed = model.model.embed_tokens.weight
        self.weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) - (
            0 if cfg.tie_word_embeddings else embed.numel() * embed.element_size())
        self.weight_bytes += sum(w.nbytes for w in held_quantized_weights(model))  # quantized: not parameters
        self.matmul_params = sum(p.numel() for n, p in model.named_parameters() if p.dim() >= 2
                                 and "embed_tokens" not in n and "experts" not in n)
        self.matmul_params += sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, QuantLinear))
        # of matmul_params, those multiplied at the FP8 rate (W8A8 FP8 projections and experts)
        self.fp8_params = sum(m.in_features * m.out_features for m in model.modules()
                              if isinstance(m, QuantLinear) and isinstance(m.scheme, Fp8BlockScheme))
        if cfg.num_experts:  # only the routed experts a token uses count towards its FLOPs
            expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
            routed = sum(cfg.moe_layers) * cfg.num_experts_per_tok * expert
            self.matmul_params += routed
            if any(isinstance(m, QuantExperts) and isinstance(m.schemes["down_proj"], Fp8BlockScheme)
                   for m in model.modules()):
                self.fp8_params += routed
        kv_dtype_bytes = model.attention_layers[0].k_cache.element_size()
        self.kv_bytes_per_token = 2 * cfg.num_kv_heads * cfg.head_dim * kv_dtype_bytes * len(cfg.full_attention_layers)
        gdn = model.gdn_layers[0]
        self.state_bytes = len(model.gdn_layers) * (gdn.ssm_state[0].numel() * gdn.ssm_state.element_size()
                                                    + gdn.conv_state[0].numel() * gdn.conv_state.element_size())
        self.cfg = cfg

    def decode_step(self, batch: int, context: int) -> float:
        """Seconds: weights once, KV of every sequence, state read + written per sequence."""
        moved = self.weight_bytes + batch * (context * self.kv_bytes_per_token + 2 * self.state_bytes)
        return moved / self.bandwidth

    def prefill(self, tokens: int) -> float:
        """Seconds: 2 x params x tokens (FP8 products at the FP8 rate) + causal attention (4 x T^2/2 x heads x
        head_dim per layer, bf16)."""
        cfg = self.cfg
        attention = 2 * tokens * tokens * cfg.num_heads * cfg.head_dim * len(cfg.full_attention_layers)
        bf16 = 2 * (self.matmul_params - self.fp8_params) * tokens + attention
        return bf16 / self.flops + 2 * self.fp8_params * tokens / self.fp8_flops


def run_workload(engine: LLMEngine, input_len: int, output_len: int, num_prompts: int, concurrency: int,
                 seed: int = 0, step_records: bool = False,
                 output_kind: RequestOutputKind = RequestOutputKind.DELTA) -> dict:
    """Random token prompts, greedy, ignore_eos; at most `concurrency` in flight. Per-request TTFT and TPOT;
    with step_records, every step's (kind, ms, prompt tokens, rows) too. Outputs are deltas, as the server asks
    for (each step's cost O(new tokens) on the host, not O(output length)), unless output_kind says otherwise."""
    gen = torch.Generator().manual_seed(seed)
    vocab = engine.model_config.vocab_size
    prompts = [torch.randint(0, vocab, (input_len,), generator=gen).tolist() for _ in range(num_prompts)]
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True, output_kind=output_kind)
    pending = list(enumerate(prompts))
    started, first, done = {}, {}, {}
    steps = StepTimes()
    t0 = time.perf_counter()
    with GcPauses() as gc_pauses:
        while pending or engine.has_unfinished():
            while pending and engine.get_num_unfinished() < concurrency:
                i, prompt = pending.pop(0)
                engine.add_request(str(i), prompt, params)
                started[str(i)] = time.perf_counter()
            outputs = engine.step()
            now = time.perf_counter()
            steps.add(engine.last_scheduled, now)
            for out in outputs:
                first.setdefault(out.request_id, now)
                if out.finished:
                    done[out.request_id] = now
    duration = time.perf_counter() - t0
    ttft = [first[r] - started[r] for r in started]
    tpot = [(done[r] - first[r]) / (output_len - 1) for r in started if output_len > 1]
    return {
        "input_len": input_len, "output_len": output_len, "num_prompts": num_prompts, "concurrency": concurrency,
        "duration_s": duration, "output_throughput": num_prompts * output_len / duration,
        "median_ttft_ms": 1e3 * statistics.median(ttft), "p99_ttft_ms": 1e3 * max(ttft),
        "median_tpot_ms": 1e3 * statistics.median(tpot) if tpot else None,
        "p99_tpot_ms": 1e3 * max(tpot) if tpot else None,
        **({"ttft_ms": [round(1e3 * t, 1) for t in ttft]} if num_prompts <= 8 else {}),
        "steps": {**steps.summary(), **gc_pauses.summary()},
        **({"step_records": steps.records} if step_records else {}),
    }


def collector_load(top: int = 5) -> str:
    """What a full collection walks now: the objects the collector tracks (after one collection; those frozen at
    start-up excluded), and the modules with the most functions among them (modules imported after the freeze:
    see `freeze_startup_objects`)."""
    gc.collect()
    tracked = gc.get_objects()
    modules = collections.Counter(getattr(o, "__module__", None) or "?" for o in tracked
                                  if type(o).__name__ == "function")
    listed = ", ".join(f"{name} {count}" for name, count in modules.most_common(top))
    return f"{len(tracked):,} objects tracked ({gc.get_freeze_count():,} frozen); functions by module: {listed}"


class GcPauses:
    """The garbage collector's full (generation 2) collections while a workload runs: how many and how long.
    A collection inside step() delays the next launch, and the device waits."""

    def __init__(self):
        self.pauses: list[float] = []
        self._started = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.pauses.append(time.perf_counter() - self._started)

    def __enter__(self) -> "GcPauses":
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)

    def summary(self) -> dict:
        return {"gc_full_collections": len(self.pauses), "gc_full_ms": round(1e3 * sum(self.pauses), 1),
                "gc_full_max_ms": round(1e3 * max(self.pauses, default=0.0), 1)}


class StepTimes:
    """Where a run's wall time went, by the kind of step: steps that compute prompt tokens (with or without
    decodes) and decode-only steps. The time between two step() calls is charged to the step the first one
    launched: with async scheduling the second call waits for that step's samples. An eager step's launch
    blocks the host once the device's launch queue is full, so the step before a run of prompt steps is
    charged with most of the first one's time and the last prompt step with little (W6: a ~490 ms "decode
    step" before each cohort of prompts, a ~70 ms prompt step after it); sums over a run are right."""

    def __init__(self):
        self.kinds: dict[str, list[float]] = {"decode": [], "prefill": []}
        self.prefill_tokens = 0
        self.samples = 0  # tokens sampled by the timed steps: over their count, how full the steps were
        self.slowest: list[tuple[float, int, int]] = []  # the slowest steps: (seconds, prompt tokens, rows)
        self.records: list[tuple[str, float, int, int]] = []  # every step: (kind, ms, prompt tokens, rows)
        self._previous: tuple[str, float, int, int, int] | None = None

    def add(self, scheduled, now: float) -> None:
        if self._previous is not None:
            kind, launched_at, prompt_tokens, rows, samples = self._previous
            self.kinds[kind].append(now - launched_at)
            self.records.append((kind, round(1e3 * (now - launched_at), 2), prompt_tokens, rows))
            self.samples += samples
            self.slowest = sorted(self.slowest + [(now - launched_at, prompt_tokens, rows)], reverse=True)[:5]
        if scheduled is None or scheduled.is_empty:
            self._previous = None
            return
        prompt_tokens = sum(len(row.token_ids) for row in scheduled.sequences if len(row.token_ids) > 1)
        self.prefill_tokens += prompt_tokens
        samples = sum(row.sample for row in scheduled.sequences)
        self._previous = ("prefill" if prompt_tokens else "decode", now, prompt_tokens, len(scheduled.sequences),
                          samples)

    def summary(self) -> dict:
        out = {"prefill_tokens": self.prefill_tokens}
        for kind, times in self.kinds.items():
            out[f"{kind}_steps"] = len(times)
            out[f"{kind}_s"] = round(sum(times), 3)
            out[f"{kind}_median_ms"] = round(1e3 * statistics.median(times), 2) if times else None
            if len(times) >= 10:  # the tail: how much of the kind's time lies above its median step
                ordered = sorted(times)
                out[f"{kind}_p90_ms"] = round(1e3 * ordered[len(ordered) * 9 // 10], 2)
                out[f"{kind}_max_ms"] = round(1e3 * ordered[-1], 2)
                median = statistics.median(times)
                out[f"{kind}_above_median_s"] = round(sum(t - median for t in times if t > median), 3)
        steps = sum(map(len, self.kinds.values()))
        out["samples_per_step"] = round(self.samples / steps, 1) if steps else None
        out["slowest"] = [f"{1e3 * t:.0f} ms ({tokens} prompt tokens, {rows} rows)" for t, tokens, rows in self.slowest]
        return out


class CompileLog:
    """Triton kernel variants compiled (or loaded from the disk cache) while a workload ran: a step that meets
    a new specialisation of a kernel (a new constexpr, or an integer argument newly divisible by 16) pays for
    it there, which a benchmark should show rather than average away."""

    def __init__(self):
        self.names: list[str] = []
        self.signatures: list[str] = []  # each variant with its argument types (what Triton specialized on)

    def install(self) -> None:
        import triton

        triton.knobs.runtime.jit_cache_hook = self._hook

    def _hook(self, *, fn, compile, **_):
        self.names.append(fn.name)
        # argument types and the specializations that made the variant new (Triton's own `repr` misnames them)
        signature = f"{fn.name}: {compile['signature']} {compile['configs']}"
        self.signatures.append(signature)
        logging.getLogger(__name__).debug("compiling %s", signature)
        return False  # go on and compile

    def take(self) -> str:
        """The variants compiled since the last call, as 'kernel x count, ...'; their signatures are in
        `signatures` until this call."""
        counts: dict[str, int] = {}
        for name in self.names:
            counts[name] = counts.get(name, 0) + 1
        self.names, self.signatures = [], []
        return ", ".join(f"{name} x{count}" for name, count in sorted(counts.items(), key=lambda kv: -kv[1]))


def _run_one(engine: LLMEngine, request_id: str, prompt: list[int], output_len: int) -> tuple[float, list[int], int]:
    """Run one request alone; returns (TTFT seconds, output token ids, cached prompt tokens)."""
    engine.add_request(request_id, prompt, SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True))
    start, first, final = time.perf_counter(), None, None
    while engine.has_unfinished():
        for out in engine.step():
            first = first or time.perf_counter()
            if out.finished:
                final = out
    return first - start, final.outputs[0].token_ids, final.num_cached_tokens


def run_shared_prefix(engine: LLMEngine, prefix_len: int = 36864, suffix_len: int = 16, num: int = 5,
                      profile_hit: bool = False) -> dict:
    """W4: cold TTFT of the first prompt, then TTFT of prompts that share its prefix (prefix-cache hits).
    With profile_hit, one more hit runs under the profiler and its top kernels are printed."""
    gen = torch.Generator().manual_seed(4)
    vocab = engine.model_config.vocab_size
    # warm-up: compile the kernels a hit uses (short chunks over a cached prefix) before timing the cold run
    warm_prefix = torch.randint(0, vocab, (2048,), generator=gen).tolist()
    for i in range(2):
        _run_one(engine, f"w4-warm-{i}", warm_prefix + torch.randint(0, vocab, (suffix_len,), generator=gen).tolist(), 1)
    prefix = torch.randint(0, vocab, (prefix_len,), generator=gen).tolist()
    ttfts, cached = [], []
    for i in range(num):
        suffix = torch.randint(0, vocab, (suffix_len,), generator=gen).tolist()
        ttft, _, hit = _run_one(engine, f"w4-{i}", prefix + suffix, 1)
        ttfts.append(ttft)
        cached.append(hit)
    if profile_hit:
        from torch.profiler import ProfilerActivity, profile as torch_profile

        suffix = torch.randint(0, vocab, (suffix_len,), generator=gen).tolist()
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            ttft, _, _ = _run_one(engine, "w4-profile", prefix + suffix, 1)
        print(f"--- profile: prefix-cache hit, {suffix_len} new tokens after {prefix_len}: TTFT {1e3 * ttft:.1f} ms",
              flush=True)
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=60))
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60),
              flush=True)
    return {"cold_ttft_ms": 1e3 * ttfts[0], "cached_ttft_ms": 1e3 * statistics.median(ttfts[1:]),
            "speedup": ttfts[0] / statistics.median(ttfts[1:]), "cached_tokens": cached}


def run_multi_turn(engine: LLMEngine, turns: int = 8, first_len: int = 2000, new_len: int = 2000,
                   output_len: int = 256) -> dict:
    """W5: one agent session; TTFT of every turn (each resends the whole conversation)."""
    gen = torch.Generator().manual_seed(5)
    vocab = engine.model_config.vocab_size
    prompt = torch.randint(0, vocab, (first_len,), generator=gen).tolist()
    ttfts, cached = [], []
    for turn in range(turns):
        ttft, answer, hit = _run_one(engine, f"w5-{turn}", prompt, output_len)
        ttfts.append(1e3 * ttft)
        cached.append(hit)
        prompt = prompt + answer + torch.randint(0, vocab, (new_len,), generator=gen).tolist()
    return {"ttft_by_turn_ms": ttfts, "cached_tokens": cached, "turn8_over_turn2": ttfts[-1] / ttfts[1]}


def profile(engine: LLMEngine, input_len: int = 8192, decode_steps: int = 8, save_dir: str | None = None,
            batch: int = 64, batch_input_len: int = 1024) -> None:
    """Print where the GPU time of a prompt's prefill and of a few batch-1 decode steps goes (top kernels);
    with save_dir, every kernel's line is also written there (profile_*.txt)."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    gen = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, engine.model_config.vocab_size, (input_len,), generator=gen).tolist()
    engine.add_request("profile", prompt, SamplingParams(temperature=0, max_tokens=decode_steps + 2,
                                                         ignore_eos=True))
    for title in (f"prefill of {input_len} tokens (until the first token)", f"{decode_steps} decode steps, batch 1"):
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t, steps = time.perf_counter(), 0
            while True:
                outputs = engine.step()
                steps += 1
                if title.startswith("prefill") and outputs or steps == decode_steps:
                    break
            torch.cuda.synchronize()
            wall = time.perf_counter() - t
        print_profile(prof, f"{title}: {steps} steps", steps, wall,
                      save_dir and f"{save_dir}/profile_{'prefill' if title.startswith('prefill') else 'batch1'}.txt")
    while engine.has_unfinished():
        engine.step()
    profile_decode_batch(engine, batch=batch, input_len=batch_input_len, save_dir=save_dir)


def print_profile(prof, title: str, steps: int, wall: float, save_as: str | None = None) -> None:
    """The wall and GPU-busy time per step of a profiled run, and its top kernels; with save_as, a file
    with every kernel."""
    events = prof.key_averages()
    gpu_total = sum(e.self_device_time_total for e in events) / 1e3
    heading = f"--- profile: {title}: wall {1e3 * wall / steps:.2f} ms/step, GPU busy {gpu_total / steps:.2f} ms/step"
    print(heading, flush=True)
    print(events.table(sort_by="self_cuda_time_total", row_limit=22, max_name_column_width=60), flush=True)
    if save_as:
        with open(save_as, "w") as f:
            f.write(heading + "\n" + events.table(sort_by="self_cuda_time_total", row_limit=-1,
                                                  max_name_column_width=120))
        trace = save_as.removesuffix(".txt") + ".trace.json"
        prof.export_chrome_trace(trace)  # the timeline: where the GPU waits for the host (benchmarks/trace_gaps.py)
        with open(trace, "rb") as raw, gzip.open(trace + ".gz", "wb") as packed:
            shutil.copyfileobj(raw, packed)
        os.remove(trace)


def profile_decode_batch(engine: LLMEngine, batch: int = 64, input_len: int = 1024, decode_steps: int = 8,
                         save_dir: str | None = None) -> None:
    """Print where the GPU time of decode steps at `batch` sequences goes (W6's steady state)."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    gen = torch.Generator().manual_seed(8)
    # long enough that the first prompts still decode when the last ones have been prefilled; aborted after
    params = SamplingParams(temperature=0, max_tokens=input_len, ignore_eos=True)
    ids = [f"profile-b{i}" for i in range(batch)]
    for request_id in ids:
        engine.add_request(request_id, torch.randint(0, engine.model_config.vocab_size, (input_len,),
                                                     generator=gen).tolist(), params)
    started = set()
    while len(started) < batch:  # until every prompt is prefilled and decoding
        started |= {out.request_id for out in engine.step()}
    engine.step()
    torch.cuda.synchronize()
    rows: list[int] = []  # each profiled step's decode rows: fewer than `batch` where the KV pool holds fewer
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        for _ in range(decode_steps):
            engine.step()
            rows.append(len(engine.last_scheduled.sequences))
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    title = f"{decode_steps} decode steps, batch {batch}"
    if min(rows) < batch:
        title += f" (NOT {batch} rows: the steps ran {rows}; the KV pool or max_num_seqs holds fewer sequences)"
    print_profile(prof, title, decode_steps, wall, save_dir and f"{save_dir}/profile_batch{batch}.txt")
    engine.abort_request(ids)
    while engine.has_unfinished():
        engine.step()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.offline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="checkpoint or config.json directory")
    parser.add_argument("--workloads", default="W1",
                        help="comma-separated ids: " + ",".join(list(WORKLOADS) + list(PREFIX_WORKLOADS)))
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--quantization", default=None, help="as `deltaserve serve` takes it (default: the "
                        "checkpoint's own; fp8 quantizes a bf16 one at load)")
    parser.add_argument("--tokenizer", default=None,
                        help="detokenize outputs with this tokenizer, as a server does (default: none, token ids "
                             "only; `python -m deltaserve.bench.vocab_tokenizer` makes one for a config)")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                        help="overlap the host work of a step with the previous step on the GPU")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--kv-cache-dtype", default="auto", help="as `deltaserve serve` takes it (auto, fp8, ...)")
    parser.add_argument("--mamba-ssm-cache-dtype", default="auto", choices=SSM_CACHE_DTYPES,
                        help="the GDN recurrent state's dtype, as `deltaserve serve` takes it (auto: the config's)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply prompt counts (quick runs: 0.34)")
    parser.add_argument("--out", help="append JSON lines of results here")
    parser.add_argument("--profile", action="store_true", help="print the top GPU kernels of a prefill and a decode")
    parser.add_argument("--profile-prompt-len", type=int, default=8192,
                        help="with --profile, the prompt tokens of the profiled prefill (W3: 8192, W1: 1024)")
    parser.add_argument("--profile-batch", type=int, default=64,
                        help="with --profile, the sequences of the profiled decode batch (W6: 64, W7: 16)")
    parser.add_argument("--profile-batch-prompt-len", type=int, default=1024,
                        help="with --profile, the prompt tokens of each sequence of that batch (W7: 8192)")
    parser.add_argument("--profile-dir", help="with --profile, also write every kernel's line to files here, and "
                        "each profile's timeline (Chrome trace, gzipped)")
    parser.add_argument("--concurrency", default=None,
                        help="comma-separated: run only the workloads' entries at these concurrencies (W6: 64 or "
                             "256; W1,W6 with 1,64 runs W1 and W6 at 64)")
    parser.add_argument("--step-records", action="store_true",
                        help="with --out, also write every step of the concurrent workloads: kind, ms, prompt "
                             "tokens, rows")
    args = parser.parse_args(argv)
    names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = [w for w in names if w not in WORKLOADS and w not in PREFIX_WORKLOADS]
    if unknown:
        parser.error(f"--workloads: unknown {unknown}; known {sorted(WORKLOADS)}")
    if args.tokenizer is not None and not os.path.isdir(args.tokenizer):
        parser.error(f"--tokenizer {args.tokenizer!r} is not a directory")
    for flag in ("profile_prompt_len", "profile_batch", "profile_batch_prompt_len"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    offered = {conc for name in names for *_, conc in WORKLOADS.get(name, [])}
    concurrencies = None
    if args.concurrency is not None:
        try:
            concurrencies = {int(c) for c in args.concurrency.split(",") if c.strip()}
        except ValueError:
            parser.error(f"--concurrency must be comma-separated integers, got {args.concurrency!r}")
        if not concurrencies:
            parser.error(f"--concurrency names no concurrency: {args.concurrency!r}")
        if not concurrencies <= offered:
            parser.error(f"--concurrency {args.concurrency}: no entry of {','.join(names)} runs at "
                         f"{sorted(concurrencies - offered)} (they run at {sorted(offered)})")
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")  # the engine's plan and warm-up
    bandwidth, flops = measure_device()
    sustained = measure_sustained_matmul()
    fp8_flops = measure_fp8_matmul()
    print(f"device: {torch.cuda.get_device_name()}  copy bandwidth {bandwidth / 1e12:.2f} TB/s  "
          f"bf16 matmul {flops / 1e12:.0f} TFLOP/s (limits use this), {sustained / 1e12:.0f} sustained"
          + (f"; fp8 {fp8_flops / 1e12:.0f} TFLOP/s" if fp8_flops else ""), flush=True)
    compiles = CompileLog()
    compiles.install()
    t = time.perf_counter()
    engine = LLMEngine(EngineConfig(
        model=args.model, load_format=args.load_format, quantization=args.quantization,
        skip_tokenizer_init=args.tokenizer is None,
        tokenizer=args.tokenizer, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        enforce_eager=args.enforce_eager, gpu_memory_utilization=args.gpu_memory_utilization,
        async_scheduling=args.async_scheduling, kv_cache_dtype=args.kv_cache_dtype,
        mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype))
    print(f"engine ready in {time.perf_counter() - t:.1f} s; Triton kernel variants compiled: {compiles.take()}",
          flush=True)
    print(f"garbage collector: {collector_load()}", flush=True)
    limits = Limits(engine, bandwidth, flops, fp8_flops)
    if args.profile:
        if args.profile_dir:
            os.makedirs(args.profile_dir, exist_ok=True)
        profile(engine, input_len=args.profile_prompt_len, save_dir=args.profile_dir, batch=args.profile_batch,
                batch_input_len=args.profile_batch_prompt_len)
    for name in names:
        if name in PREFIX_WORKLOADS:
            r = run_shared_prefix(engine, profile_hit=args.profile) if name == "W4" else run_multi_turn(engine)
            r["workload"] = name
            print(f"{name} ({PREFIX_WORKLOADS[name]}): {json.dumps(r)}", flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(r) + "\n")
            continue
        for input_len, output_len, num, conc in WORKLOADS[name]:
            if concurrencies is not None and conc not in concurrencies:
                continue
            num = max(1, round(num * args.scale))
            # Every prompt set draws from its own seed: two runs sharing a seed would share their first
            # tokens, and the prefix cache would serve the second from the first.
            seed = zlib.crc32(f"{name} {input_len} {output_len} {conc}".encode())
            run_workload(engine, min(input_len, 256), 4, 1, 1, seed=seed + 1)  # warm-up
            compiles.take()
            r = run_workload(engine, input_len, output_len, num, conc, seed=seed,
                             step_records=args.step_records and conc > 1)
            r["triton_compile_signatures"] = compiles.signatures
            r["triton_compiles"] = compiles.take()
            r["workload"] = name
            r["ttft_limit_ms"] = 1e3 * limits.prefill(input_len)
            r["ttft_limit_sustained_ms"] = r["ttft_limit_ms"] * flops / sustained
            if r["median_tpot_ms"] is not None:
                r["tpot_limit_ms"] = 1e3 * limits.decode_step(min(conc, num), input_len + output_len // 2)
            line = (f"{name} in={input_len} out={output_len} n={num} c={conc}: "
                    f"TTFT median {r['median_ttft_ms']:.1f} ms (limit {r['ttft_limit_ms']:.1f}, "
                    f"{r['ttft_limit_ms'] / r['median_ttft_ms']:.0%} of it; {r['ttft_limit_sustained_ms']:.1f} at "
                    f"the sustained matmul rate)")
            if r["median_tpot_ms"] is not None:
                line += (f"; TPOT median {r['median_tpot_ms']:.2f} ms (limit {r['tpot_limit_ms']:.2f}, "
                         f"{r['tpot_limit_ms'] / r['median_tpot_ms']:.0%}); {r['output_throughput']:.0f} output tok/s")
            if "ttft_ms" in r:
                line += f"; TTFT each {r['ttft_ms']} ms"
            if conc > 1:
                st = r["steps"]
                line += (f"; steps with prompt tokens {st['prefill_steps']} ({st['prefill_s']} s, median "
                         f"{st['prefill_median_ms']} ms), decode-only {st['decode_steps']} ({st['decode_s']} s, "
                         f"median {st['decode_median_ms']} ms, p90 {st.get('decode_p90_ms')}, max "
                         f"{st.get('decode_max_ms')}, {st.get('decode_above_median_s')} s above the median), "
                         f"{st['samples_per_step']} tokens sampled a step; {st['gc_full_collections']} full "
                         f"garbage collections ({st['gc_full_ms']} ms, longest {st['gc_full_max_ms']}); "
                         f"slowest steps: {', '.join(st['slowest'])}")
            if r["triton_compiles"]:
                line += f"; Triton kernels compiled during it: {r['triton_compiles']}"
            print(line, flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
