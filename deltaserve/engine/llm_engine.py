"""LLMEngine: requests in, batched steps, outputs out. The step-level API the server and `LLM` use.

    add_request(id, prompt, params) -> scheduler.waiting
    step():  scheduler.schedule() -> runner.launch() -> runner.collect() -> scheduler.update_from_output()
             -> detokenize; with async scheduling (the default) step k+1 is launched before step k's
             samples are collected, and a request's new token is reported one call later
    abort_request(id) frees everything at any stage.

A request with n > 1 runs as n child sequences ("{id}#{i}"), reported together as one RequestOutput.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from dataclasses import dataclass, field

import torch

from deltaserve.config import EngineConfig, ModelConfig
from deltaserve.engine.detokenize import IncrementalDetokenizer
from deltaserve.engine.scheduler import Scheduler
from deltaserve.engine.setup import EngineSetup
from deltaserve.outputs import CompletionOutput, Logprob, RequestOutput
from deltaserve.request import Request, RequestStatus
from deltaserve.sampling import RequestOutputKind, SamplingParams, make_generator
from deltaserve.sched_output import SchedulerOutput
from deltaserve.worker.model_runner import LaunchedStep

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
        self.model_path = setup.model_path  # the checkpoint directory (the demo model's when none was given)
        self.runner = setup.runner
        self.cache_manager = setup.cache_manager
        self.scheduler = Scheduler(setup.cache_manager, setup.max_num_seqs, config.max_num_batched_tokens,
                                   self.max_model_len)
        self.eos_token_ids = setup.eos_token_ids
        self._parents: dict[str, _Parent] = {}
        self._in_flight: tuple[SchedulerOutput, LaunchedStep] | None = None  # launched, samples not read yet
        self.last_scheduled: SchedulerOutput | None = None  # what the latest step() launched (benchmarks read it)
        self._child_parent: dict[str, str] = {}
        if torch.device(self.runner.device).type == "cuda":
            self.warm_up()

    def warm_up(self) -> None:
        """Run once, before serving, the kind of steps whose kernels compile (Triton) or get planned (cuDNN)
        at their first use, so that no user's first request pays for it (seconds on an H200): a prompt of two
        full chunks and a short tail (chunks over a cached prefix, a checkpoint inside the step), a few short
        requests, then a prompt that joins while they all decode (one step of decodes and a prompt, with enough
        decoding sequences for the GDN op to split it), then a resend of that prompt with a new ending (a
        prefix-cache hit). Their outputs are dropped and the prefix cache is emptied after them."""
        from deltaserve.ops.gdn.cuda import SPLIT_MIN_SHORT_SEQS

        longest = self.max_model_len - 8  # room for the outputs and for the resend's longer ending
        if longest < 16:
            return
        start = time.perf_counter()
        vocab, budget, block = self.model_config.vocab_size, self.config.max_num_batched_tokens, self.config.block_size

        def prompt(length: int, salt: int) -> list[int]:
            return [(i * 7919 + salt * 104729) % vocab for i in range(length)]

        def run_until(done) -> None:
            while self.has_unfinished() and not done(self.step()):
                pass

        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        self.add_request("deltaserve-warm-up-long", prompt(min(2 * budget + 2 * block + 3, longest), 1), params)
        run_until(lambda outputs: bool(outputs))  # its first token: it decodes from now on
        for i in range(SPLIT_MIN_SHORT_SEQS):
            self.add_request(f"deltaserve-warm-up-decode-{i}", prompt(min(20, longest), 10 + i), params)
        run_until(lambda outputs: len(outputs) > 1)  # the short ones decode too
        # longer than the recurrent GDN path takes, and enough to fill the GPU with unsplit attention programs (the
        # kernel variant a batch of prompts meets)
        joining = prompt(min(max(300, budget // 2), longest), 2)
        self.add_request("deltaserve-warm-up-joining", joining, params)
        run_until(lambda outputs: False)
        self.add_request("deltaserve-warm-up-hit", joining[:-5] + prompt(9, 3), params)
        run_until(lambda outputs: False)
        self.reset_prefix_cache()
        logger.info("warm-up (the first use of each kind of step) took %.1f s", time.perf_counter() - start)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (KV blocks and GDN checkpoints) and zero the hit counters, as vLLM's
        reset_prefix_cache. False, and nothing changes, while requests are unfinished."""
        if self.has_unfinished():
            return False
        while self._in_flight is not None:  # the last step's checkpoints are committed when it is read back
            self.step()
        self.cache_manager.reset_prefix_cache()
        return True

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
        parent = _Parent(request_id, text, ids, params.output_kind, arrival_time=arrival_time or time.monotonic())
        for i, child_id in enumerate(child_ids):
            request = Request(child_id, ids, params, max(1, max_tokens), self.eos_token_ids, arrival_time,
                              request_id if group is None else group)
            if params.seed is not None:  # children of one seeded request draw different samples
                request.generator = make_generator(params.seed + i, self.runner.device)
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
            ids = self.tokenizer.encode(prompt, add_special_tokens=False)
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
        touched: dict[str, _Parent] = {}
        # Taken out before it is processed: a step whose processing raised is never processed again.
        previous, self._in_flight = self._in_flight, None
        if previous is not None and self._must_wait():
            self._process(*previous, touched)
            previous = None
        scheduled = self.last_scheduled = self.scheduler.schedule()
        launched = None if scheduled.is_empty else (scheduled, self.runner.launch(scheduled))
        if self.config.async_scheduling:
            self._in_flight = launched
        if previous is not None:
            self._process(*previous, touched)
        if launched is not None and not self.config.async_scheduling:
            self._process(*launched, touched)
        return [self._make_output(parent) for parent in touched.values()
                if parent.output_kind is not RequestOutputKind.FINAL_ONLY
                or all(child.finish_reason is not None for child in parent.children)]

    def _must_wait(self) -> bool:
        """The step in flight must be read back before the next is scheduled: async scheduling is off, or a
        running request's sampling needs its latest token on the host (penalties, min_tokens)."""
        return not self.config.async_scheduling or any(r.needs_host_history for r in self.scheduler.running)

    def _process(self, scheduled: SchedulerOutput, launched: LaunchedStep, touched: dict[str, _Parent]) -> None:
        """Read back a launched step's samples and record them (parents that got tokens go into `touched`)."""
        model_output = self.runner.collect(launched)
        updated = self.scheduler.update_from_output(scheduled, model_output)
        now = time.monotonic()
        for request in updated:
            parent_id = self._child_parent.get(request.request_id)
            parent = self._parents.get(parent_id)
            if parent is None:
                continue
            children = parent.children
            child = children[0] if len(children) == 1 else next(c for c in children if c.request is request)
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
            child.finish_reason = request.status.value
            child.stop_reason = request.stop_reason
            if child.detok is not None:
                released = child.detok.finish()
                if keeps_deltas and released:
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
        if len(children) == 1:  # the common case, without generator expressions (~1 us a request a step)
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
