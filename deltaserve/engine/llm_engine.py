"""LLMEngine: requests in, batched steps, outputs out. The step-level API the server and `LLM` use.

    add_request(id, prompt, params) -> scheduler.waiting
    step():  scheduler.schedule() -> runner.launch() -> runner.collect() -> scheduler.update_from_output()
             -> detokenize; with async scheduling (the default) step k+1 is launched before step k's
             samples are collected, and a request's new token is reported one call later
             with pipeline parallelism (-pp N, async scheduling): up to N micro-batches in flight, each over its own
             sequences (_step_micro_batches), so that the stages overlap
    abort_request(id) frees everything at any stage.

A request with n > 1 runs as n child sequences ("{id}#{i}"), reported together as one RequestOutput.

Structured output (params.structured_outputs): each child sequence gets a GrammarState (`Request.grammar`). A
step with such rows is launched without its sampling; once the previous step's tokens have advanced the states,
the step's bitmask is filled on the host while the device runs its forward, and the sampling is queued with it
(`_sample_with_grammar`). A state that ends (its grammar complete, a refused token, a dead end) finishes its
sequence with finish_reason "stop"; the failures are logged with their reason.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from deltaserve.config import EngineConfig, ModelConfig
from deltaserve.engine import tokenize
from deltaserve.engine.detokenize import IncrementalDetokenizer
from deltaserve.engine.scheduler import Scheduler
from deltaserve.worker.setup import EngineSetup
from deltaserve.outputs import CompletionOutput, Logprob, RequestOutput
from deltaserve.request import Request, RequestStatus
from deltaserve.sampling import RequestOutputKind, SamplingParams
from deltaserve.sched_output import SchedulerOutput
from deltaserve.structured.compiler import GrammarCompiler
from deltaserve.structured.matcher import GrammarState, fill_bitmask
from deltaserve.worker import warm_up
from deltaserve.worker.model_runner import LaunchedStep
from deltaserve.worker.step_trace import EngineTrace

logger = logging.getLogger(__name__)


@dataclass
class _Child:
    request: Request
    detok: IncrementalDetokenizer | None
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    unsent_text: list[str] = field(default_factory=list)  # text released since the last delta output
    num_tokens_sent: int = 0  # output tokens (and logprob entries) in earlier delta outputs


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    output_kind: RequestOutputKind
    children: list[_Child] = field(default_factory=list)
    arrival_time: float = 0.0
    first_token_time: float | None = None


def freeze_startup_objects() -> None:
    """Move every object alive when the first engine starts (torch's, transformers' and Triton's modules and
    functions: millions) out of the garbage collector's reach, once per process. Otherwise each full
    collection walks them all while serving (see docs/performance.md). The engine's own objects, and all made
    later, are collected as usual: an engine that is dropped is freed."""
    global _startup_frozen
    if not _startup_frozen:
        _startup_frozen = True
        # Modules start-up would import later, so that they are frozen too (~900 modules, ~140K objects each):
        # torch's compiler stack (dynamo, sympy), imported when the model is built under a device context (nn.init
        # through torch._refs), and on the GPU fla (the GDN prefill kernels), which brings torch's inductor.
        import torch._dynamo  # noqa: F401
        if torch.cuda.is_available():
            with contextlib.suppress(ImportError):  # an optional dependency: the GPU op reports its absence
                import fla.ops.gated_delta_rule  # noqa: F401
        gc.collect()
        gc.freeze()


_startup_frozen = False


class LLMEngine:
    def __new__(cls, *args, **kwargs):
        freeze_startup_objects()  # before the engine exists: it is collected like any object made later
        return super().__new__(cls)

    def __init__(self, config: EngineConfig):
        setup = EngineSetup(config)
        self.config = config
        self.model_config: ModelConfig = setup.model_config
        self.tokenizer = setup.tokenizer
        self.max_model_len = setup.max_model_len
        self.memory_plan = setup.memory_plan  # the memory budget the caches were sized from
        self.resolved = setup.resolved  # dtypes, clamped sizes and graph sizes, resolved with the plan
        self.model_path = setup.model_path  # the checkpoint directory (the demo model's when none was given)
        self.runner = setup.runner
        self.cache_manager = setup.cache_manager
        # pipeline stages overlap when each runs another step: as many steps in flight as stages (micro-batches)
        self._num_micro_batches = config.pipeline_parallel_size if config.async_scheduling else 1
        self.scheduler = Scheduler(setup.cache_manager, setup.max_num_seqs, config.max_num_batched_tokens,
                                   self.max_model_len, self._num_micro_batches)
        self.eos_token_ids = setup.eos_token_ids
        self._parents: dict[str, _Parent] = {}
        self._in_flight: tuple[SchedulerOutput, LaunchedStep] | None = None  # launched, samples not read yet
        self._micro_batches: deque[tuple[SchedulerOutput, LaunchedStep]] = deque()  # the same, oldest first (-pp)
        self.last_scheduled: SchedulerOutput | None = None  # what the latest step() launched (benchmarks read it)
        self._child_parent: dict[str, str] = {}
        self._grammar_compiler: GrammarCompiler | None = None  # built at the first structured-output request
        # in this process, or in the worker processes of -tp / -pp
        self._trace: EngineTrace | None = None  # set after the warm-up: its steps are not served ones
        if "cuda" in (torch.device(self.runner.device).type, getattr(self.runner, "workers_device_type", None)):
            self.warm_up()
        self._trace = EngineTrace.from_env()

    def warm_up(self) -> None:
        """A few real steps of each kind before serving, so that no first request compiles a kernel
        (worker/warm_up.engine_steps); then the allocator's free cached blocks handed back (the warm-up's one-off
        shapes leave them; with expandable segments their pages are unmapped, docs/memory.md), the memory in
        use logged against the budget, the runner's memory ceiling set (its eager steps hand back cached blocks
        above it: warm_up.eager_memory_ceiling), and any kernel compiled from then on logged
        (warm_up.watch_compiles): by each worker process for its GPU under -tp / -pp."""
        warm_up.engine_steps(self)
        if getattr(self.runner, "workers_device_type", None) is not None:  # -tp / -pp: each worker, for its GPU
            self.runner.after_warm_up(self.memory_plan)
            return
        warm_up.watch_compiles()
        torch.cuda.empty_cache()
        in_use = warm_up.check_memory(self.memory_plan, torch.device(self.runner.device))
        if in_use is not None:
            # eager steps keep to the budget, or to what start-up left in use and their planned activations
            self.runner.memory_ceiling = warm_up.eager_memory_ceiling(self.memory_plan, in_use)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (KV blocks and GDN checkpoints) and zero the hit counters, as vLLM's
        reset_prefix_cache. False, and nothing changes, while requests are unfinished."""
        if self.has_unfinished():
            return False
        while self._in_flight is not None or self._micro_batches:  # checkpoints are committed as steps are read
            self.step()
        self.cache_manager.reset_prefix_cache()
        return True

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """Compiles structured-output constraints for this engine's tokenizer (the server compiles each request's
        before adding it; the engine's own compile is then a cache hit)."""
        if self._grammar_compiler is None:
            self._grammar_compiler = GrammarCompiler(self.tokenizer, self.model_config.vocab_size,
                                                     self.eos_token_ids)
        return self._grammar_compiler

    # -- requests ------------------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None, group: str | None = None) -> None:
        """Queue a request. Raises ValueError (naming the problem) for an id in use or an unusable prompt.

        `group` names the client request it is part of (default: its own id); the scheduler admits fairly between
        groups, so that one client's many sequences cannot keep every other client waiting.
        """
        params = params or SamplingParams()
        child_ids = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        for used in (request_id, *child_ids):  # "x#0" may be a child of "x": checked before anything changes
            if used in self._parents or used in self._child_parent:
                raise ValueError(f"request id {used!r} is already in use")
        text = prompt if isinstance(prompt, str) else None
        ids = self._encode(prompt)
        if len(ids) > self.max_model_len:
            raise ValueError(f"This model's maximum context length is {self.max_model_len} tokens, "
                             f"you requested {len(ids)} tokens in the prompt")
        max_tokens = self.max_model_len - len(ids) if params.max_tokens is None else params.max_tokens
        constraint = None
        if params.structured_outputs is not None:
            constraint = self.grammar_compiler.compile(params.structured_outputs)
        parent = _Parent(request_id, text, ids, params.output_kind, arrival_time=arrival_time or time.monotonic())
        for i, child_id in enumerate(child_ids):
            request = Request(child_id, ids, params, max(1, max_tokens), self.eos_token_ids, arrival_time,
                              request_id if group is None else group)
            if params.seed is not None:  # children of one seeded request draw different samples
                request.seed = params.seed + i
            if constraint is not None:
                request.grammar = GrammarState(constraint)
            detok = None
            if self.tokenizer is not None:
                detok = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens, params.stop,
                                               params.include_stop_str_in_output)
            parent.children.append(_Child(request, detok, [] if params.logprobs is not None else None))
        for child in parent.children:  # nothing above raised: the request is accepted
            self._child_parent[child.request.request_id] = request_id
            self.scheduler.add_request(child.request)
        self._parents[request_id] = parent

    def _encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: pass token ids, not text")
            ids = tokenize.encode(self.tokenizer, prompt, add_special_tokens=False)
        elif type(prompt) is tokenize.CheckedTokenIds and prompt:
            return prompt
        else:
            ids = list(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        # type() is int excludes bool and every other type; one pass of it plus min/max is several times
        # cheaper than per-token range checks on a 100K-token prompt
        if all(type(t) is int for t in ids) and 0 <= min(ids) and max(ids) < vocab:
            return ids
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]!r} is out of range [0, {vocab})")
        return ids  # int subclasses (an IntEnum, say) are fine

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Abort requests at any stage, freeing their cache. Unknown or finished ids are ignored."""
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            parent = self._parents.pop(request_id, None)
            if parent is None:
                continue
            for child in parent.children:
                self.scheduler.abort_request(child.request.request_id)
                self._child_parent.pop(child.request.request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self._parents)

    def get_num_unfinished(self) -> int:
        return len(self._parents)

    # -- one step ------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one batched forward pass; return the outputs of requests that got new tokens.

        With async scheduling the step is launched before the previous one's samples are read back, so the
        device never waits for the host between steps; its own outputs are returned by the next call.
        """
        if self._num_micro_batches > 1:
            return self._step_micro_batches()
        touched: dict[str, _Parent] = {}
        # Taken out before it is processed: a step whose processing raised is never processed again.
        previous, self._in_flight = self._in_flight, None
        if previous is not None and self._must_wait():
            self._process(*previous, touched)
            previous = None
        scheduled = self.last_scheduled = self.scheduler.schedule()
        launched = None if scheduled.is_empty else self._launch(scheduled)
        if self.config.async_scheduling:
            self._in_flight = launched
        if previous is not None:
            self._process(*previous, touched)
        if launched is not None and launched[1].deferred is not None:
            self._sample_with_grammar(*launched, touched)
        if launched is not None and not self.config.async_scheduling:
            self._process(*launched, touched)
        return self._outputs(touched)

    def _step_micro_batches(self) -> list[RequestOutput]:
        """Pipeline parallelism: launch one micro-batch, keeping up to one per stage in flight, so that the first
        stage runs it while later stages run the earlier ones. The oldest is read back first when all are in
        flight, or instead of a launch when every schedulable sequence is in flight (the scheduler never puts one
        sequence in two steps in flight, so no row waits for a pending sample)."""
        touched: dict[str, _Parent] = {}
        if len(self._micro_batches) == self._num_micro_batches:
            self._process_oldest(touched)
        scheduled = self.last_scheduled = self.scheduler.schedule()
        if scheduled.is_empty:
            if self._micro_batches:
                self._process_oldest(touched)
        else:
            launched = self._launch(scheduled)
            self._micro_batches.append(launched)
            if launched[1].deferred is not None:  # its rows' earlier tokens are all read back and accepted
                self._sample_with_grammar(*launched, touched)
        return self._outputs(touched)

    def _launch(self, scheduled: SchedulerOutput) -> tuple[SchedulerOutput, LaunchedStep]:
        """Launch a non-empty step on the runner; constrained: some row samples under a grammar this step."""
        constrained = any(row.grammar is not None and row.sample for row in scheduled.sequences)
        began = time.monotonic_ns() if self._trace is not None else 0
        launched = self.runner.launch(scheduled, constrained)
        if self._trace is not None:
            self._trace.launched(launched, len(scheduled.sequences), scheduled.num_tokens, began)
        return scheduled, launched

    def _process_oldest(self, touched: dict[str, _Parent]) -> None:
        """Read back the oldest micro-batch, taken out first (as in step()). If that raises (a rank failed), its
        sequences are no longer in flight for the scheduler: the next step schedules them again, and its launch
        reports the failure at once instead of finding nothing to run."""
        scheduled, launched = self._micro_batches.popleft()
        try:
            self._process(scheduled, launched, touched)
        except BaseException:
            self.scheduler.release(scheduled)
            raise

    def _outputs(self, touched: dict[str, _Parent]) -> list[RequestOutput]:
        return [self._make_output(parent) for parent in touched.values()
                if parent.output_kind is not RequestOutputKind.FINAL_ONLY
                or all(child.finish_reason is not None for child in parent.children)]

    def _must_wait(self) -> bool:
        """The step in flight must be read back before the next is scheduled: async scheduling is off, or a
        running request's sampling needs its latest token on the host (penalties, min_tokens)."""
        return not self.config.async_scheduling or any(r.needs_host_history for r in self.scheduler.running)

    def _sample_with_grammar(self, scheduled: SchedulerOutput, launched: LaunchedStep,
                             touched: dict[str, _Parent]) -> None:
        """Fill the launched step's grammar bitmask (every earlier token of its rows is resolved and accepted by
        now) and queue its sampling. A row whose grammar allows no token ends its sequence here."""
        rows = launched.deferred[0]
        states = [(i, row.grammar) for i, row in enumerate(rows) if row.grammar is not None]
        bitmask = self.runner.grammar_bitmask(len(rows), self.model_config.vocab_size)
        masked = fill_bitmask(states, bitmask)
        for i, state in states:
            if state.end is not None:  # a dead end found by this fill, or a sequence that ended earlier
                self._end_by_grammar(rows[i].request_id, rows[i].serial, touched)
        self.runner.sample(launched, bitmask, masked)

    def _end_by_grammar(self, request_id: str, serial: int, touched: dict[str, _Parent]) -> None:
        """Finish a sequence, if still live, whose grammar state has ended, and report it."""
        parent = self._parents.get(self._child_parent.get(request_id))
        child = next((c for c in parent.children if c.request.serial == serial), None) if parent else None
        if child is None or child.request.status.finished:
            return
        self._stop_for_grammar(child.request)
        self._close_child(child, child.request)
        touched[parent.request_id] = parent

    def _stop_for_grammar(self, request: Request) -> None:
        """Finish a request with "stop" because its grammar state ended; a failure is logged with its reason."""
        if request.grammar.error:
            logger.warning("request %s: %s; it ends here (finish_reason 'stop')", request.request_id,
                           request.grammar.end)
        self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)

    def _process(self, scheduled: SchedulerOutput, launched: LaunchedStep, touched: dict[str, _Parent]) -> None:
        """Read back a launched step's samples and record them (parents that got tokens go into `touched`)."""
        began = time.monotonic_ns() if self._trace is not None else 0
        model_output = self.runner.collect(launched)
        if self._trace is not None:
            self._trace.collected(launched, began)
        updated = self.scheduler.update_from_output(scheduled, model_output)
        now = time.monotonic()
        for request in updated:
            parent_id = self._child_parent.get(request.request_id)
            parent = self._parents.get(parent_id)
            if parent is None:
                continue
            children = parent.children
            child = children[0] if len(children) == 1 else next(c for c in children if c.request is request)
            grammar = request.grammar
            if grammar is not None and not request.status.finished:
                grammar.accept(request.all_token_ids[-1])
                if grammar.end is not None:  # the grammar's stop token (not an EOS here), or a refused one
                    self._stop_for_grammar(request)
            self._record_token(child, request, model_output)
            parent.first_token_time = parent.first_token_time or now
            touched[parent.request_id] = parent

    def _record_token(self, child: _Child, request: Request, model_output) -> None:
        token = request.all_token_ids[-1]
        logprob = model_output.logprobs.get(request.request_id)
        if logprob is not None:
            child.cumulative_logprob += logprob
        if child.logprobs is not None:
            entry = {token: Logprob(logprob)}
            for rank, (tid, lp) in enumerate(model_output.top_logprobs.get(request.request_id, []), start=1):
                entry.setdefault(tid, Logprob(lp, rank))
                if tid == token:
                    entry[tid].rank = rank
            child.logprobs.append(entry)
        # the EOS / stop token id that ended a request is not part of its text (as in vLLM)
        stopped_by_token = request.status == RequestStatus.FINISHED_STOPPED
        keeps_deltas = request.params.output_kind is RequestOutputKind.DELTA
        if child.detok is not None and not (stopped_by_token and not request.params.include_stop_str_in_output):
            released = child.detok.append(token)
            if keeps_deltas and released:
                child.unsent_text.append(released)
            if child.detok.stopped_by is not None and not request.status.finished:
                self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
                request.stop_reason = child.detok.stopped_by
        if request.status.finished:
            self._close_child(child, request)

    @staticmethod
    def _close_child(child: _Child, request: Request) -> None:
        """A finished sequence: its finish reason, and the text its detokenizer still held back."""
        child.finish_reason = request.status.value
        child.stop_reason = request.stop_reason
        if child.detok is not None:
            released = child.detok.finish()
            if request.params.output_kind is RequestOutputKind.DELTA and released:
                child.unsent_text.append(released)

    def _make_output(self, parent: _Parent) -> RequestOutput:
        """The parent's output now: cumulative (O(length) to build), or for DELTA only what is new (O(new))."""
        outputs = []
        delta = parent.output_kind is RequestOutputKind.DELTA
        for index, child in enumerate(parent.children):
            request = child.request
            if delta:
                text = "".join(child.unsent_text)
                child.unsent_text.clear()
                token_ids = request.all_token_ids[len(request.prompt_token_ids) + child.num_tokens_sent:]
                logprobs = child.logprobs[child.num_tokens_sent:] if child.logprobs is not None else None
                child.num_tokens_sent += len(token_ids)
            else:
                text = child.detok.text if child.detok is not None else ""
                token_ids, logprobs = list(request.output_token_ids), child.logprobs
            outputs.append(CompletionOutput(
                index=index,
                text=text,
                token_ids=token_ids,
                # as in vLLM: only for requests that asked for logprobs (others may skip computing them)
                cumulative_logprob=child.cumulative_logprob if child.logprobs is not None else None,
                logprobs=logprobs,
                finish_reason=child.finish_reason,
                stop_reason=child.stop_reason,
            ))
        children = parent.children
        if len(children) == 1:  # the common case, without generator expressions (run per request per step)
            finished, cached = children[0].finish_reason is not None, children[0].request.num_cached_tokens
        else:
            finished = all(c.finish_reason is not None for c in children)
            cached = max(c.request.num_cached_tokens for c in children)
        if finished:
            self._parents.pop(parent.request_id, None)
            for child in children:
                self._child_parent.pop(child.request.request_id, None)
        metrics = {"arrival_time": parent.arrival_time, "first_token_time": parent.first_token_time}
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, outputs, finished,
                             cached, metrics)
