"""When requests go out: vLLM's ready check, warm-ups, its arrival schedule, the concurrency limit and the timed run.

The ready check (vLLM's, on by default) sends a request of the workload's first request's lengths once before
anything is timed, again every READY_CHECK_RETRY_S while the server is unreachable or answers 5xx, so that a
server still starting is waited for and its first request's one-time costs stay out of the figures; a 4xx answer
is the request's fault and ends the run at once. Its prompt is its own (serve.build_workload): vLLM sends the
first request itself, whose timed copy a server with prefix caching then answers from its cache.

Arrival times follow `vllm bench serve`: gaps drawn from a gamma distribution (shape = burstiness,
mean = 1 / rate; burstiness 1 is a Poisson process), then scaled so the last arrival is at exactly
num / rate seconds; rate inf sends everything at once. A request that arrives while --max-concurrency
requests are in flight waits for one to finish, and its clock (TTFT, E2EL) starts when it is sent.
The benchmark duration runs from the first arrival to the end of the last request.
"""

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace

import aiohttp
import numpy as np
from tqdm import tqdm

from deltaserve.bench import multi_turn
from deltaserve.bench.client import Endpoint, RequestInput, RequestOutput, send_request
from deltaserve.bench.errors import BenchInputError

HTTP_TIMEOUT_S = 6 * 60 * 60  # vLLM's: long enough for any single request
READY_CHECK_RETRY_S = 5.0  # vLLM's wait between ready-check requests


@dataclass
class Workload:
    """What to send: single-turn requests, or multi-turn sessions (whose prompts are built as they run)."""

    requests: list[RequestInput]
    sessions: list[multi_turn.SessionPlan]
    session_id_prefix: str  # request id of a session turn: prefix + "s<session>-t<turn>"
    warmup: RequestInput  # the ready check's request (id suffixed -ready), then --num-warmups times (-<i>)

    @property
    def num_requests(self) -> int:
        return len(self.requests) + sum(plan.num_turns for plan in self.sessions)


@dataclass
class TimedRun:
    """The timed part of a run: every request sent (in workload order) and what it measured."""

    inputs: list[RequestInput]
    outputs: list[RequestOutput]
    turn_indices: list[int]  # turn of each request (all 0 for single-turn workloads)
    duration_s: float


def arrival_offsets(num: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Send time of each of `num` arrivals, in seconds after the start (see the module docstring)."""
    if request_rate == float("inf"):
        return [0.0] * num
    if burstiness == float("inf"):
        gaps = np.full(num, 1.0 / request_rate)
    else:
        rng = np.random.default_rng(seed)
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num)
    offsets = np.cumsum(gaps)
    # vLLM rescales so that every seed spends exactly num / rate seconds sending (the raw sum is off by 1-2%).
    offsets *= (num / request_rate) / offsets[-1]
    return offsets.tolist()


async def dispatch(
    jobs: Sequence[Callable[[], Awaitable]], offsets: Sequence[float], max_concurrency: int | None
) -> list:
    """Start job i at offsets[i] seconds from now, at most max_concurrency running; results in job order."""
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def limited(job: Callable[[], Awaitable]):
        if semaphore is None:
            return await job()
        async with semaphore:
            return await job()

    start = time.perf_counter()
    tasks = []
    for job, offset in zip(jobs, offsets):
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(limited(job)))
    return await asyncio.gather(*tasks)


async def ready_check(session: aiohttp.ClientSession, endpoint: Endpoint, request: RequestInput,
                      timeout_s: float) -> None:
    """Send `request` (its id suffixed -ready) until it succeeds, every READY_CHECK_RETRY_S for at most timeout_s
    seconds while the server is unreachable or answers 5xx. Raises BenchInputError naming the last error when it
    never succeeds, or at once when the server refuses the request (4xx)."""
    request = replace(request, request_id=f"{request.request_id}-ready")
    deadline = time.perf_counter() + timeout_s
    while True:
        output = await send_request(session, endpoint, request)
        if output.success:
            return
        if output.error.startswith("HTTP 4"):
            raise BenchInputError(f"the initial test request to {endpoint.api_url} was refused: {output.error}")
        left = deadline - time.perf_counter()
        if left <= 0:
            raise BenchInputError(f"the initial test request to {endpoint.api_url} did not succeed within "
                                  f"--ready-check-timeout-sec {timeout_s:g}: {output.error}")
        await asyncio.sleep(min(READY_CHECK_RETRY_S, left))


async def run_traffic(
    endpoint: Endpoint,
    workload: Workload,
    *,
    request_rate: float,
    burstiness: float,
    seed: int,
    max_concurrency: int | None,
    num_warmups: int,
    show_progress: bool,
    ready_check_timeout_s: float = 0,
) -> TimedRun:
    """The ready check and the warm-ups, then the workload (arrivals per request, or per session for
    multi-turn)."""
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0, keepalive_timeout=60)
    timeout = aiohttp.ClientTimeout(total=HTTP_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        if ready_check_timeout_s > 0:
            print("Starting initial single prompt test run...")
            await ready_check(session, endpoint, workload.warmup, ready_check_timeout_s)
            print("Initial test run completed.")
        else:
            print("Skipping endpoint ready check.")
        if num_warmups:
            print(f"Warming up with {num_warmups} requests...")
            # distinct ids: some servers refuse a request id that is already in flight
            warmups = [replace(workload.warmup, request_id=f"{workload.warmup.request_id}-{i}")
                       for i in range(num_warmups)]
            warmup_jobs = [lambda request=request: send_request(session, endpoint, request) for request in warmups]
            await dispatch(warmup_jobs, [0.0] * num_warmups, max_concurrency)

        progress = tqdm(total=workload.num_requests, disable=not show_progress)

        async def send(request: RequestInput) -> RequestOutput:
            output = await send_request(session, endpoint, request)
            progress.update(1)
            return output

        num_arrivals = len(workload.sessions) or len(workload.requests)
        offsets = arrival_offsets(num_arrivals, request_rate, burstiness, seed)
        print(f"Traffic request rate: {request_rate}, burstiness: {burstiness}, "
              f"maximum request concurrency: {max_concurrency}")
        start = time.perf_counter()
        if workload.sessions:
            inputs, outputs, turn_indices = await multi_turn.gather_sessions(
                workload.sessions, endpoint.chat, workload.session_id_prefix, send,
                lambda jobs: dispatch(jobs, offsets, max_concurrency),
            )
        else:
            inputs = workload.requests
            jobs = [lambda request=request: send(request) for request in inputs]
            outputs = await dispatch(jobs, offsets, max_concurrency)
            turn_indices = [0] * len(inputs)
        duration = time.perf_counter() - start
        progress.close()
    return TimedRun(inputs, outputs, turn_indices, duration)
