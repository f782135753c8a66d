"""Closed-loop random-prompt traffic (W6's shape) through the real scheduler, each step charged by a cost model:
scheduling policies weighed without a GPU.

    python -m benchmarks.schedule_model [--concurrency 64] [--prompts 256] [--input-len 1024]
        [--output-len 512] [--max-num-batched-tokens 8192] [--staggered-chunk-tokens 0] [--chunk-us 70] ...

The scheduler (engine/scheduler.py, with the prefix cache's chunk cuts of cache/cache_manager.py) picks each step's
rows; every sampled token is 1 (ignore_eos), and a client sends its next prompt when its request finishes. A step
costs, by kind (defaults measured on an H200 with Qwen3.5-27B, docs/performance.md, seventh to ninth sessions):

    decode   only decode rows, a CUDA graph of D rows: linear from 13.8 ms at 1 row (W1's TPOT) to 21.77 ms at 64
             (W6's decode-only step, ninth session)
    prompt   any step with prompt tokens (eager): 49 ms + 78 us a prompt token (W6's steps of 1,091, 2,139 and
             8,146 prompt tokens: 134, 200 and 683 ms)
    mixed    (the staggered bound only) D decode rows and one prompt chunk replayed together: the decode step
             + 0.6 ms + chunk_us a prompt token (sixth session: 128 tokens cost 8.9 ms, 70 us a token)

With the defaults it gives W6 at concurrency 64 as 36 prompt steps and 2,020 decode-only steps, 1,981 tok/s
(measured: 36, 2,023 and 1,950-1,955; with the eighth session's 22.04 ms step it gave 1,965 against 1,940 measured).

--staggered-chunk-tokens C replaces the scheduler by an ideal it does not implement, as a bound on what steps of
decodes and one prompt chunk could give (the mixed CUDA-graph steps, measured slower on W6, were removed; their
code is on the branch wip/mixed-graph-steps): every step carries all decoding requests and up to C prompt tokens
(oldest prompt first), so that requests start and finish a few steps apart and every step after the first wave is
a mixed one, costed as above (a step without decodes as the 1-row decode step plus its chunk).
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass, field

from deltaserve.cache.block_pool import BlockPool
from deltaserve.cache.cache_manager import CacheManager
from deltaserve.cache.prefix_cache import PrefixCache
from deltaserve.cache.state_pool import StatePool
from deltaserve.engine.scheduler import Scheduler
from deltaserve.request import Request
from deltaserve.sampling import SamplingParams
from deltaserve.sched_output import ModelOutput, SchedulerOutput


@dataclass
class StepCosts:
    """Milliseconds a step takes, by kind (see the module docstring)."""

    decode_ms_1: float = 13.8
    decode_ms_64: float = 21.77
    mixed_extra_ms: float = 0.6
    chunk_us: float = 70.0
    prompt_fixed_ms: float = 49.0
    prompt_us: float = 78.0

    def decode(self, rows: int) -> float:
        return self.decode_ms_1 + (self.decode_ms_64 - self.decode_ms_1) * (max(rows, 1) - 1) / 63


@dataclass
class Traffic:
    concurrency: int = 64
    prompts: int = 256
    input_len: int = 1024
    output_len: int = 512


@dataclass
class ModelResult:
    seconds: float
    output_tokens: int
    steps: dict[str, list] = field(default_factory=lambda: {"decode": [0, 0.0], "mixed": [0, 0.0],
                                                            "prompt": [0, 0.0]})  # kind -> [count, ms]

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds

    def __str__(self) -> str:
        kinds = ", ".join(f"{kind} {count} steps ({ms / 1000:.2f} s)" for kind, (count, ms) in self.steps.items())
        return f"{self.tokens_per_second:,.0f} output tok/s in {self.seconds:.2f} s: {kinds}"


def step_kind(scheduled: SchedulerOutput) -> tuple[str, int, int]:
    """(kind, decode rows, prompt tokens) of a scheduled step."""
    rows = scheduled.sequences
    decodes = sum(1 for row in rows if row.num_computed >= len(row.prompt_token_ids) and len(row.token_ids) == 1)
    prompt_tokens = sum(len(row.token_ids) for row in rows) - decodes
    return ("prompt" if prompt_tokens else "decode"), decodes, prompt_tokens


def simulate(traffic: Traffic, costs: StepCosts, max_num_batched_tokens: int = 8192, block_size: int = 16,
             seed: int = 0) -> ModelResult:
    """Run the traffic to the end through a Scheduler with prefix caching on (random prompts: no hits)."""
    blocks_per_request = -(-(traffic.input_len + traffic.output_len) // block_size)
    blocks = BlockPool(traffic.concurrency * blocks_per_request * 2 + 1, block_size)
    states = StatePool(traffic.concurrency + 1, traffic.concurrency)
    cache = CacheManager(blocks, states, PrefixCache(blocks, states, "schedule-model"))
    scheduler = Scheduler(cache, traffic.concurrency, max_num_batched_tokens, traffic.input_len + traffic.output_len)
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=traffic.output_len, ignore_eos=True)
    sent = 0

    def send() -> None:
        nonlocal sent
        prompt = [rng.randrange(1, 1 << 20) for _ in range(traffic.input_len)]
        scheduler.add_request(Request(str(sent), prompt, params, traffic.output_len, set()))
        sent += 1

    for _ in range(min(traffic.concurrency, traffic.prompts)):
        send()
    result = ModelResult(0.0, traffic.prompts * traffic.output_len)
    while scheduler.has_unfinished():
        scheduled = scheduler.schedule()
        kind, decodes, prompt_tokens = step_kind(scheduled)
        if kind == "decode":
            ms = costs.decode(decodes)
        else:
            ms = costs.prompt_fixed_ms + costs.prompt_us * prompt_tokens / 1000
        result.steps[kind][0] += 1
        result.steps[kind][1] += ms
        result.seconds += ms / 1000
        sampled = {row.request_id: 1 for row in scheduled.sequences if row.sample}
        for request in scheduler.update_from_output(scheduled, ModelOutput(sampled, {}, {})):
            if request.status.finished and sent < traffic.prompts:
                send()
    return result


def simulate_staggered(traffic: Traffic, costs: StepCosts, chunk_tokens: int) -> ModelResult:
    """The ideal staggered schedule of the module docstring: each step all decodes plus <= chunk_tokens prompt
    tokens, a finished request's seat taken by the next prompt at once."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be at least 1 (no prompt would ever finish), got {chunk_tokens}")
    waiting = traffic.prompts
    prefilled: list[int] = []  # prompt tokens computed, per request in its prefill (oldest first)
    decoded: list[int] = []  # output tokens, per decoding request
    result = ModelResult(0.0, traffic.prompts * traffic.output_len)
    while waiting or prefilled or decoded:
        admitted = min(traffic.concurrency - len(prefilled) - len(decoded), waiting)
        prefilled += [0] * admitted
        waiting -= admitted
        decodes, budget = len(decoded), chunk_tokens
        decoded = [count + 1 for count in decoded]  # this step's token for each decoding request
        for i, done in enumerate(prefilled):
            take = min(budget, traffic.input_len - done)
            prefilled[i] += take
            budget -= take
        chunk = chunk_tokens - budget
        # a prompt's last chunk samples its first output token, as the engine's does
        decoded += [1 for done in prefilled if done == traffic.input_len]
        prefilled = [done for done in prefilled if done < traffic.input_len]
        decoded = [count for count in decoded if count < traffic.output_len]
        kind = "mixed" if chunk else "decode"
        ms = costs.decode(decodes) + (costs.mixed_extra_ms + costs.chunk_us * chunk / 1000 if chunk else 0.0)
        result.steps[kind][0] += 1
        result.steps[kind][1] += ms
        result.seconds += ms / 1000
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.schedule_model", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    traffic, costs = Traffic(), StepCosts()
    for name, value in (*vars(traffic).items(), *vars(costs).items()):
        parser.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--staggered-chunk-tokens", type=int, default=0,
                        help="model the ideal staggered schedule instead, this many prompt tokens a step (see above)")
    args = parser.parse_args(argv)
    for name in ("concurrency", "prompts", "input_len", "output_len", "max_num_batched_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.staggered_chunk_tokens < 0:
        parser.error(f"--staggered-chunk-tokens must be 0 (none) or more, got {args.staggered_chunk_tokens}")
    traffic = Traffic(**{name: getattr(args, name) for name in vars(traffic)})
    costs = StepCosts(**{name: getattr(args, name) for name in vars(costs)})
    if args.staggered_chunk_tokens:
        print(simulate_staggered(traffic, costs, args.staggered_chunk_tokens))
    else:
        print(simulate(traffic, costs, args.max_num_batched_tokens))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
