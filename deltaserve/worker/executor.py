"""MultiprocExecutor: one worker process per rank (tensor x pipeline), driven by the engine's one scheduler.

The engine process loads no weights: it spawns `tp * pp` workers (torch.multiprocessing, spawn), each of which
joins a torch.distributed group (NCCL on its own GPU, gloo on the CPU), loads its stage's layers and runs a
ModelRunner. Every step the engine sends the same SchedulerOutput to every rank; stages pass hidden states
between them (ModelRunner._through_stage) and the last stage's TP rank 0 sends the samples back.

Transport engine <-> workers: one multiprocessing Pipe per rank, the step pickled once and its bytes written to
each. A pipe, unlike a collective, lets the engine wait on every rank's pipe and process sentinel at once with a
timeout (multiprocessing.connection.wait), so a dead or failed rank is reported by number instead of hanging.

It offers LLMEngine what ModelRunner does (launch / sample / collect / grammar_bitmask / device). Steps are sent
without waiting for earlier ones' samples: with pipeline parallelism the engine keeps one micro-batch per stage
in flight (disjoint sequences), and the first stage takes the next step as soon as it has passed its outputs on,
while the later stages still run the earlier ones. A row whose input is a sample not yet back (async scheduling
without micro-batches) gets it filled in here, once it is back. Each worker drains its pipe on a thread, so that
the engine's write of a step never waits for that rank's compute.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing.connection
import pickle
import queue
import socket
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from deltaserve.resolved_config import ResolvedConfig
from deltaserve.sched_output import ModelOutput, ScheduledSequence, SchedulerOutput
from deltaserve.structured import bitmask as grammar_bitmask
from deltaserve.worker.distributed import ParallelContext
from deltaserve.worker.step_trace import StepTrace

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0  # loading a stage's weights
PEER_DEATH_WAIT_S = 2.0  # a rank's error may follow a peer's death: how long to wait for that death to show
STEP_TIMEOUT_S = 300.0  # one step's samples; also torch.distributed's own timeout on the workers' collectives


class RankFailed(RuntimeError):
    """A worker process died or raised: the engine cannot run steps any more."""


@dataclass
class WorkerSpec:
    """What every worker needs to build its part of the model (pickled to the spawned processes)."""

    model_path: object
    model_config: object
    dtype: torch.dtype
    device_type: str
    load_format: str
    seed: int
    weight_format: object
    cache_shape: object
    resolved: ResolvedConfig
    tp_size: int
    pp_size: int
    port: int


@dataclass
class ExecutorStep:
    """A step sent (or, deferred, to be sent by `sample`) to the workers; `output` once read back."""

    scheduled: SchedulerOutput
    request_ids: list[str]
    deferred: tuple[list[ScheduledSequence], None] | None = None
    output: ModelOutput | None = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _parallel_context(rank: int, tp_size: int, pp_size: int) -> ParallelContext:
    """This rank's place (rank = pp_rank * tp_size + tp_rank) and its stage's TP group; every rank creates
    every group, as dist.new_group requires."""
    pp_rank, tp_rank = divmod(rank, tp_size)
    group = None
    if tp_size > 1:
        for stage in range(pp_size):
            created = dist.new_group(list(range(stage * tp_size, (stage + 1) * tp_size)))
            if stage == pp_rank:
                group = created
    return ParallelContext(tp_rank, tp_size, pp_rank, pp_size, group)


def cpu_threads_per_rank(world_size: int) -> int:
    """A CPU rank's intra-op threads: the ranks share the threads torch would give one process (the host's cores, or
    OMP_NUM_THREADS), each takes its share (the idle threads of oversubscribed ranks spin and delay every
    collective)."""
    return max(1, torch.get_num_threads() // world_size)


def _drain(conn, inbox: queue.SimpleQueue) -> None:
    """Move the engine's messages into `inbox` as they arrive (None once the engine's end is closed): a step sent
    while this rank computes (or writes its output) waits in the queue, never in the pipe."""
    try:
        while True:
            inbox.put(conn.recv_bytes())
    except (EOFError, OSError):
        inbox.put(None)


def _worker_main(rank: int, spec: WorkerSpec, conn) -> None:
    """One rank: join the group, load the stage, then run every step the engine sends until "stop"."""
    from deltaserve.model.loader import load_model
    from deltaserve.worker.model_runner import ModelRunner

    world = spec.tp_size * spec.pp_size
    try:
        if spec.device_type == "cuda":
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
            torch.set_num_threads(cpu_threads_per_rank(world))
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{spec.port}",
                                rank=rank, world_size=world, timeout=timedelta(seconds=STEP_TIMEOUT_S))
        parallel = _parallel_context(rank, spec.tp_size, spec.pp_size)
        model = load_model(spec.model_path, spec.model_config, spec.dtype, device, spec.load_format, spec.seed,
                           spec.weight_format, parallel)
        runner = ModelRunner(model, spec.cache_shape, device, spec.resolved)
        reports = parallel.is_last_stage and parallel.tp_rank == 0
        trace = StepTrace.from_env(rank)
        inbox = queue.SimpleQueue()
        threading.Thread(target=_drain, args=(conn, inbox), daemon=True, name="deltaserve-pipe").start()
        conn.send(("ready", None))
        while (message := inbox.get()) is not None:
            kind, payload = pickle.loads(message)
            if kind == "stop":
                break
            if kind == "after_warm_up":
                _after_warm_up(runner, payload)
                continue
            if trace is not None:
                trace.begin()
            scheduled, bitmask, masked = payload
            step = runner.launch(scheduled, defer_sample=bitmask is not None)
            if step.deferred is not None:
                runner.sample(step, bitmask, masked)
            output = runner.collect(step)
            if trace is not None:  # before the output leaves: the engine's next step comes after this time
                trace.end()
            if reports:
                conn.send(("output", output))
    except Exception:
        conn.send(("error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _after_warm_up(runner, plan) -> None:
    """A rank on a GPU once the engine's warm-up steps ran: as LLMEngine.warm_up does in one process, its free
    cached blocks handed back, its memory logged against the plan's budget, its memory ceiling set, and
    any kernel it compiles from then on logged."""
    from deltaserve.worker import warm_up

    if runner.device.type != "cuda":
        return
    warm_up.watch_compiles()
    torch.cuda.empty_cache()
    in_use = warm_up.check_memory(plan, runner.device)
    if in_use is not None:
        runner.memory_ceiling = warm_up.eager_memory_ceiling(plan, in_use)


class MultiprocExecutor:
    def __init__(self, spec: WorkerSpec):
        self.world_size = spec.tp_size * spec.pp_size
        self.device = torch.device("cpu")  # the engine's side; the workers hold the model and generators
        self.workers_device_type = spec.device_type
        self._tp_size = spec.tp_size
        context = mp.get_context("spawn")
        self._conns, self._procs = [], []
        for rank in range(self.world_size):
            parent, child = context.Pipe()
            proc = context.Process(target=_worker_main, args=(rank, spec, child), daemon=True,
                                   name=f"deltaserve-rank-{rank}")
            proc.start()
            self._conns.append(parent)
            self._procs.append(proc)
        self._reporter = self.world_size - spec.tp_size  # the last stage's TP rank 0
        self._steps: list[ExecutorStep] = []  # sent, not read back yet, in order
        self._last_sampled: dict[str, int] = {}
        self.failed: str | None = None
        self._receive(set(range(self.world_size)), "ready", START_TIMEOUT_S)
        logger.info("%d worker processes ready (tensor parallel %d x pipeline parallel %d)", self.world_size,
                    spec.tp_size, spec.pp_size)

    def _describe(self, rank: int) -> str:
        pp_rank, tp_rank = divmod(rank, self._tp_size)
        return f"rank {rank} (pipeline stage {pp_rank}, tensor-parallel rank {tp_rank})"

    def _fail(self, message: str) -> RankFailed:
        self.failed = message
        logger.error("%s", message)
        return RankFailed(message)

    def _receive(self, ranks: set[int], kind: str, timeout: float) -> object:
        """The next `kind` message of each rank in `ranks` (the payload of the last one); raises RankFailed when
        any rank died or raised, or they did not all answer within `timeout` seconds."""
        if self.failed is not None:
            raise RankFailed(self.failed)
        deadline, payload, ranks = time.monotonic() + timeout, None, set(ranks)
        while ranks:
            left = deadline - time.monotonic()
            ready = multiprocessing.connection.wait(self._conns + [p.sentinel for p in self._procs], max(left, 0))
            if not ready:
                raise self._fail(f"no answer from {self._describe(min(ranks))} within {timeout:.0f} s")
            self._raise_if_died()
            for r, conn in enumerate(self._conns):
                if conn in ready and conn.poll(0):
                    try:
                        message_kind, payload = conn.recv()
                    except (EOFError, OSError):
                        continue  # the process is gone: its sentinel says so below
                    if message_kind == "error":
                        # a peer's death makes the others' collectives fail: name the dead rank, not them
                        others = [p.sentinel for i, p in enumerate(self._procs) if i != r and p.exitcode is None]
                        multiprocessing.connection.wait(others, PEER_DEATH_WAIT_S)
                        self._raise_if_died()
                        raise self._fail(f"{self._describe(r)} failed:\n{payload}")
                    if r not in ranks or message_kind != kind:
                        raise self._fail(f"{self._describe(r)} sent {message_kind!r}, expected {kind!r}")
                    ranks.discard(r)
            for r, proc in enumerate(self._procs):
                if proc.sentinel in ready and not self._conns[r].poll(0):
                    raise self._fail(f"{self._describe(r)} died (exit code {proc.exitcode})")
        return payload

    def _raise_if_died(self) -> None:
        # a process's sentinel fires as it closes its files, a moment before it can be reaped: join those
        ended = multiprocessing.connection.wait([p.sentinel for p in self._procs], 0)
        for r, proc in enumerate(self._procs):
            if proc.sentinel in ended:
                proc.join(PEER_DEATH_WAIT_S)
            if proc.exitcode not in (None, 0):
                raise self._fail(f"{self._describe(r)} died (exit code {proc.exitcode})")

    def _broadcast(self, kind: str, payload) -> None:
        """One message to every rank, pickled once."""
        if self.failed is not None:
            raise RankFailed(self.failed)
        data = pickle.dumps((kind, payload))
        for rank, conn in enumerate(self._conns):
            try:
                conn.send_bytes(data)
            except OSError as exc:
                raise self._fail(f"{self._describe(rank)} cannot be reached: {exc}") from exc

    def _send(self, step: ExecutorStep, bitmask: torch.Tensor | None = None, masked: list[int] = ()) -> None:
        self._broadcast("step", (step.scheduled, bitmask, list(masked)))
        self._steps.append(step)

    def _read_until(self, step: ExecutorStep) -> None:
        while step.output is None:
            oldest = self._steps.pop(0)
            oldest.output = self._receive({self._reporter}, "output", STEP_TIMEOUT_S)
            self._last_sampled = oldest.output.sampled

    def _fill_pending(self, scheduled: SchedulerOutput) -> SchedulerOutput:
        """Rows whose last input is the previous step's sample get it, once that step is read back."""
        if not any(r.pending_input for r in scheduled.sequences):
            return scheduled
        if self._steps:
            self._read_until(self._steps[-1])
        rows = []
        for row in scheduled.sequences:
            if row.pending_input:
                row = dataclasses.replace(row, token_ids=[*row.token_ids[:-1], self._last_sampled[row.request_id]],
                                          pending_input=False)
            rows.append(row)
        return dataclasses.replace(scheduled, sequences=rows)

    def launch(self, scheduled: SchedulerOutput, defer_sample: bool = False) -> ExecutorStep:
        if self.failed is not None:
            raise RankFailed(self.failed)
        scheduled = self._fill_pending(scheduled)
        chosen = [r for r in scheduled.sequences if r.sample]
        step = ExecutorStep(scheduled, [r.request_id for r in chosen], (chosen, None) if defer_sample else None)
        if not defer_sample:
            self._send(step)
        return step

    @staticmethod
    def grammar_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
        return torch.empty(num_rows, grammar_bitmask.bitmask_width(vocab_size), dtype=torch.int32)

    def sample(self, step: ExecutorStep, bitmask: torch.Tensor | None = None, masked_rows: list[int] = ()) -> None:
        step.deferred = None
        self._send(step, bitmask.clone() if bitmask is not None and masked_rows else None, masked_rows)

    def collect(self, step: ExecutorStep) -> ModelOutput:
        self._read_until(step)  # the reporter answers every step, in order
        return step.output

    def after_warm_up(self, plan) -> None:
        """Tell every rank that the engine's warm-up steps have run (see _after_warm_up); it takes the message
        before any later step."""
        self._broadcast("after_warm_up", plan)

    def shutdown(self) -> None:
        """Ask every worker to stop, then wait a little for each (a hung one is killed)."""
        stop = pickle.dumps(("stop", None))
        for conn in self._conns:
            try:
                conn.send_bytes(stop)
            except OSError:
                pass
        for proc in self._procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
