"""AsyncEngine: the engine on its own thread, and an asyncio face for the HTTP server.

    HTTP handlers (event loop)                     engine thread (the only caller of the engine)
      generate(): put _Add ---- commands queue ---->  drain commands: add_request / abort_request
                  await stream.queue <-- call_soon_threadsafe -- step() -> RequestOutputs (deltas)
      abort():    put _Abort --------------------->

The engine thread blocks on the command queue when it has no work (no busy wait) and otherwise alternates
"drain commands, step"; a step's outputs reach the event loop in one hand-over (`_deliver`), not one per
request. Outputs are deltas (`RequestOutputKind.DELTA`: each step's new text, token ids and
logprobs, O(new) to build however long the output is); a handler that falls behind gets the queued ones
joined into one (`OutputAccumulator`), and a non-streaming handler joins them all (`collect_output`). An
exception in step() fails every in-flight request (their handlers answer 500) and aborts them in the
engine, freeing their cache; the thread keeps serving. `engine` is anything with LLMEngine's request API
(add_request, abort_request, step, has_unfinished, scheduler.num_running/num_waiting/num_preemptions,
cache_manager.block_pool.usage), which lets tests drive the HTTP layer with a scripted fake.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from deltaserve.outputs import CompletionOutput, OutputAccumulator, RequestOutput
from deltaserve.sampling import RequestOutputKind, SamplingParams
from deltaserve.server.metrics import ServerMetrics
from deltaserve.worker.executor import RankFailed
from deltaserve.worker.step_trace import RequestTrace

logger = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """The engine failed while running a request (the client gets a 500)."""


class EngineDeadError(EngineError):
    """The engine cannot run steps any more (a worker rank died): the client gets a 503."""


class _Aborted:
    """Queue item: the request was aborted (client gone or server shutting down); no more outputs."""


_ABORTED = _Aborted()


class _RequestStream:
    """The event-loop end of one request: outputs arrive here from the engine thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        # the step trace's times, set by the engine thread with the first token (before its delivery)
        self.added_ns = self.first_token_ns = 0

    def put(self, item) -> None:
        """Called from the engine thread."""
        _deliver([(self, item)])


@dataclass
class _Tracked:
    """Engine-thread bookkeeping of one request: where its outputs go, and timing for the metrics."""

    stream: _RequestStream
    arrival: float
    num_prompt_tokens: int
    num_choices: int = 1  # the request's n: a finished or aborted request counts once per choice
    last_token_time: float = 0.0
    num_tokens: int = 0  # output tokens seen, all choices together
    num_tokens_sent: int = 0  # output tokens already handed to the stream
    unsent: OutputAccumulator | None = None  # deltas held back by stream_interval
    added_ns: int = 0  # when the engine thread added it, where the step trace is on (its requests.tsv)


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: _RequestStream
    group: str | None = None  # the client request it belongs to (LLMEngine.add_request)
    arrival: float = field(default_factory=time.monotonic)
    queued_ns: int = field(default_factory=time.monotonic_ns)


@dataclass
class _Abort:
    request_id: str


class _AbortAll:
    """Command: abort every request in flight (shutdown's grace period is over)."""


class _Stop:
    """Command: abort everything and end the thread."""


class AsyncEngine:
    def __init__(self, engine, metrics: ServerMetrics | None = None, stream_interval: int = 1):
        self.engine = engine
        self.metrics = metrics
        self.stream_interval = stream_interval
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._tracked: dict[str, _Tracked] = {}  # engine thread only
        self._thread = threading.Thread(target=self._run, name="deltaserve-engine", daemon=True)
        # why the engine is down (a worker rank failed), once it is: requests are refused from then on
        self.dead: str | None = None
        self.on_dead: Callable[[str], None] | None = None  # called once, on the engine thread, when it goes down
        self._request_trace = RequestTrace.from_env()

    # -- the event-loop side -----------------------------------------------------------------------------

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self.dead is None

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort whatever is still running and stop the thread (idempotent)."""
        if self._thread.is_alive():
            self._commands.put(_Stop())
            self._thread.join(timeout)

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def abort_all(self) -> None:
        """Abort every request in flight; each ends with finish_reason "abort". Thread-safe."""
        self._commands.put(_AbortAll())

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       group: str | None = None) -> AsyncIterator[RequestOutput]:
        """Run one request; yields its outputs as deltas (what is new since the previous one; any output_kind
        in params is replaced), the last with `finished` set. `collect_output` joins them. `group`: the client
        request it is part of (LLMEngine.add_request; default: its own).

        If the request is aborted by the server (abort() or shutdown), the last output has finish_reason
        "abort" for every choice not finished yet. Raises ValueError if the engine refuses the request and
        EngineError if the engine fails while running it. Leaving the loop early (a client disconnect cancels
        the handler) aborts the request.
        """
        if self.dead is not None:
            raise EngineDeadError(f"the engine is down: {self.dead}")
        params = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
        stream = _RequestStream(asyncio.get_running_loop())
        add = _Add(request_id, prompt_token_ids, params, stream, group)
        self._commands.put(add)
        done = False
        latest = None  # the latest output received
        try:
            while True:
                items = [await stream.queue.get()]
                while not stream.queue.empty():  # fallen behind: join the queued deltas into one
                    items.append(stream.queue.get_nowait())
                if len(items) == 1 and isinstance(items[0], RequestOutput):  # the common case: as it is
                    output = latest = items[0]
                else:
                    deltas = OutputAccumulator()
                    for item in items:
                        if isinstance(item, BaseException):
                            done = True
                            raise item
                        if item is _ABORTED:  # already gone from the engine: end after what came before it
                            item = _aborted_output(request_id, prompt_token_ids, params, latest)
                        deltas.add(item)
                        latest = item
                    output = deltas.result()
                done = output.finished
                if self._request_trace is not None and stream.first_token_ns:
                    self._request_trace.first_output(add.queued_ns, stream.added_ns, stream.first_token_ns)
                    stream.first_token_ns = 0
                yield output
                if done:
                    return
        finally:
            if not done:
                self.abort(request_id)

    # -- the engine thread -------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            idle = not self.engine.has_unfinished()
            try:
                commands = [self._commands.get(block=idle)]
            except queue.Empty:
                commands = []
            while True:
                try:
                    commands.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            for command in commands:
                if isinstance(command, _Stop):
                    self._abort_all(_ABORTED)
                    return
                if isinstance(command, _AbortAll):
                    self._abort_all(_ABORTED)
                else:
                    self._handle(command)
            if self.dead is None and self.engine.has_unfinished():
                self._step()
            self._publish_stats()

    def _handle(self, command) -> None:
        if isinstance(command, _Abort):
            tracked = self._tracked.pop(command.request_id, None)
            self.engine.abort_request(command.request_id)
            if tracked is not None:
                _end_stream(tracked, _ABORTED)
                self._record_finish(tracked, ["abort"] * tracked.num_choices)
            return
        if self.dead is not None:
            command.stream.put(EngineDeadError(f"the engine is down: {self.dead}"))
            return
        try:
            self.engine.add_request(command.request_id, command.prompt_token_ids, command.params,
                                    group=command.group)
        except ValueError as exc:
            command.stream.put(exc)
            return
        except Exception as exc:  # any engine failure must reach the handler, not kill the thread
            logger.exception("engine failed to add request %s", command.request_id)
            command.stream.put(EngineError(f"the engine failed to add the request: {exc}"))
            return
        self._tracked[command.request_id] = _Tracked(command.stream, command.arrival,
                                                     len(command.prompt_token_ids), command.params.n,
                                                     added_ns=time.monotonic_ns() if self._request_trace else 0)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except RankFailed as exc:  # no step can run any more: refuse requests from now on
            self.dead = str(exc).splitlines()[0]
            logger.error("the engine is down (%s); failing %d in-flight request(s)", self.dead, len(self._tracked))
            self._abort_all(EngineDeadError(f"the engine is down: {self.dead}"))
            if self.on_dead is not None:
                self.on_dead(self.dead)
            return
        except Exception as exc:  # fail the requests, keep the server alive
            logger.exception("engine step failed; failing %d in-flight request(s)", len(self._tracked))
            self._abort_all(EngineError(f"the engine failed while running the request: {exc}"))
            return
        now = time.monotonic()
        deliveries: list[tuple[_RequestStream, RequestOutput]] = []
        generated, intervals = 0, []  # the step's tokens and inter-token latencies, for the metrics
        try:
            for output in outputs:
                tracked = self._tracked.get(output.request_id)
                if tracked is None:
                    continue
                generated += self._record_progress(tracked, output, now, intervals)
                unsent = tracked.num_tokens - tracked.num_tokens_sent
                first = tracked.num_tokens_sent == 0
                if tracked.unsent is not None:  # deltas held back earlier go out with this one
                    tracked.unsent.add(output)
                    output = tracked.unsent.result()
                    tracked.unsent = None
                if output.finished or first or unsent >= self.stream_interval:
                    tracked.num_tokens_sent = tracked.num_tokens
                    deliveries.append((tracked.stream, output))
                else:
                    tracked.unsent = OutputAccumulator()
                    tracked.unsent.add(output)
                if output.finished:
                    del self._tracked[output.request_id]
                    self._record_finish(tracked, [c.finish_reason or "abort" for c in output.outputs], now)
        finally:  # what was taken from _tracked is handed over whatever happens
            _deliver(deliveries)
        if self.metrics is not None:
            self.metrics.on_step(generated, intervals)

    def _abort_all(self, item) -> None:
        """Abort every tracked request in the engine and hand `item` (a sentinel or an error) to each."""
        request_ids = list(self._tracked)
        for request_id in request_ids:
            tracked = self._tracked.pop(request_id)
            _end_stream(tracked, item)
            self._record_finish(tracked, ["abort"] * tracked.num_choices)
        try:
            self.engine.abort_request(request_ids)
        except Exception:  # already failing; the log says why
            logger.exception("engine failed to abort requests after an error")

    # -- metrics -------------------------------------------------------------------------------------------

    def _record_progress(self, tracked: _Tracked, output: RequestOutput, now: float, intervals: list[float]) -> int:
        """Count a delta's new tokens (returned); a request's first ones go to the metrics at once, the
        interval since its previous ones into `intervals` (the step's, recorded together)."""
        new_tokens = sum(len(c.token_ids) for c in output.outputs)  # a delta's
        if new_tokens <= 0:
            return 0
        if tracked.num_tokens == 0:
            if tracked.added_ns:  # traced: the handler writes the line once it has this output
                tracked.stream.added_ns, tracked.stream.first_token_ns = tracked.added_ns, time.monotonic_ns()
            if self.metrics is not None:
                self.metrics.on_first_token(now - tracked.arrival, tracked.num_prompt_tokens,
                                            output.num_cached_tokens)
        else:
            intervals.append(now - tracked.last_token_time)
        tracked.num_tokens += new_tokens
        tracked.last_token_time = now
        return new_tokens

    def _record_finish(self, tracked: _Tracked, reasons: list[str], now: float | None = None) -> None:
        if self.metrics is not None:
            self.metrics.on_finished((now or time.monotonic()) - tracked.arrival, reasons)

    def _publish_stats(self) -> None:
        if self.metrics is None:
            return
        try:
            scheduler = self.engine.scheduler
            usage = self.engine.cache_manager.block_pool.usage
            self.metrics.set_engine_state(scheduler.num_running, scheduler.num_waiting, usage,
                                          scheduler.num_preemptions)
        except Exception:  # stats must never take the engine down
            logger.exception("could not read engine stats")


def _deliver(deliveries: list[tuple[_RequestStream, object]]) -> None:
    """Called from the engine thread: hand each item to its stream, in order, with one wake-up of each event
    loop for them all: one `call_soon_threadsafe` per item would cost the engine thread a wake-up per stream
    a step (docs/performance.md, "Host work a step")."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}
    for stream, item in deliveries:
        by_loop.setdefault(stream.loop, []).append((stream.queue, item))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # the event loop is closed: nobody is waiting any more
            pass


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    for stream_queue, item in items:
        stream_queue.put_nowait(item)


def _end_stream(tracked: _Tracked, item) -> None:
    """Hand a request's last item (the abort sentinel or an error) to its stream, after any held-back deltas."""
    if tracked.unsent is not None:
        tracked.stream.put(tracked.unsent.result())
        tracked.unsent = None
    tracked.stream.put(item)


def _aborted_output(request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    latest: RequestOutput | None) -> RequestOutput:
    """The last delta of an aborted request: nothing new, every choice not finished yet marked "abort" (its
    cumulative logprob and the cached-token count as the latest output had them)."""
    choices = {c.index: c for c in latest.outputs} if latest is not None else {}
    outputs = []
    for i in range(params.n):
        last = choices.get(i)
        finished = last is not None and last.finish_reason is not None
        outputs.append(CompletionOutput(i, "", [], last.cumulative_logprob if last is not None else None,
                                        [] if params.logprobs is not None else None,
                                        last.finish_reason if finished else "abort",
                                        last.stop_reason if finished else None))
    cached = latest.num_cached_tokens if latest is not None else 0
    return RequestOutput(request_id, None, prompt_token_ids, outputs, finished=True, num_cached_tokens=cached)


async def collect_output(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    """The whole output of a request from generate()'s deltas (the cumulative output of the last step)."""
    joined = OutputAccumulator()
    async for delta in outputs:
        joined.add(delta)
    return joined.result()
