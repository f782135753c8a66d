"""The scheduler: one rule, no prefill/decode phases.

Each step, every request's num_computed_tokens catches up with its num_tokens inside one token budget
(max_num_batched_tokens): running requests first (in arrival order), then waiting ones while at most
max_num_seqs run: in arrival order, except that the sequences of one client request (`Request.group`: its n
choices, its batch of prompts) take turns with other clients' (the group with the fewest running goes first).
A prompt longer than the remaining budget is cut into chunks (chunked prefill), and prefill chunks share the
step with decode tokens. When KV blocks or state slots run out, a running request is preempted (the newest of the
group with the most sequences running, so one client's fan-out gives up its cache before another client's
request): its cache is freed and it is recomputed later from its tokens, so nothing is dropped. Batching,
chunking and preemption change only which steps compute a sequence's tokens, so its greedy output is the same
token for token, except at a near tie, where the different float reduction order of another batch shape may pick
the other of two nearly equal logits (docs/architecture.md, 'What "exact" means').

With prefix caching on, a waiting request starts at its prefix hit (cached KV blocks plus a GDN state
checkpoint, copied into its working slot before the forward: `state_restores`), and prefill chunks are cut
where a checkpoint belongs, so that the runner can copy the state out after the forward (`state_saves`),
except where the checkpoint is within a block of the chunk's end (every prompt's end): the row then carries
`mid_save` and the GDN layers copy the state out inside the step. See cache/cache_manager.py for where
checkpoints go.

Micro-batches (pipeline parallelism, `num_micro_batches` > 1): the engine keeps up to that many steps in flight,
each over its own sequences, so that the first stage runs step i+1 while later stages run step i. A step then
skips the sequences of steps still in flight (`_in_flight`, until their output is taken in: a sequence is never in
two in-flight steps, so no row waits for a pending sample) and takes at most an even share of the live sequences
(`_micro_batch_rows`), leaving the rest to the next step. max_num_batched_tokens bounds each step (what one stage
computes at a time); max_num_seqs, KV blocks and state slots are shared by all steps in flight, allocated when a
step is scheduled. Preemption passes over the sequences in flight; an abort or a stop string may end one
that is (its rows are then ignored when its step's output comes back; every stage runs the steps in
order, so a later step that reuses its blocks or slot runs after it on each stage).
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque

from deltaserve.cache.cache_manager import CacheManager
from deltaserve.request import Request, RequestStatus
from deltaserve.sched_output import ModelOutput, ScheduledSequence, SchedulerOutput

logger = logging.getLogger(__name__)

PREEMPTION_WARNING_INTERVAL_S = 60.0  # at most one warning a minute: a full pool preempts every few steps


def _samples_from_history(request: Request) -> bool:
    """Whether the sampler reads this request's output tokens: penalties, or min_tokens (its length)."""
    return request.params.has_penalties or request.params.min_tokens > 0


class Scheduler:
    def __init__(self, cache: CacheManager, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 num_micro_batches: int = 1):
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []  # finished since the last launched step (SchedulerOutput)
        self.num_micro_batches = num_micro_batches  # steps the engine keeps in flight, over disjoint sequences
        # with micro-batches: the running requests of steps whose output is not taken in yet (skipped by schedule)
        self._in_flight: set[Request] = set()
        self.num_preemptions = 0  # since start-up (the server's vllm:num_preemptions)
        self._last_preemption_warning = -PREEMPTION_WARNING_INTERVAL_S

    # -- requests in and out -------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort_request(self, request_id: str) -> Request | None:
        """Finish a request at any stage and free its cache. Unknown ids are ignored (it may have finished)."""
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """End a request from outside the step (abort, or a stop string seen by the detokenizer)."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        self._finish(request, status)
        return request

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self._in_flight.discard(request)
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.cache.free(request)
        self.requests.pop(request.request_id, None)
        self._finished_ids.append(request.request_id)

    def _preempt(self, request: Request) -> None:
        """Free the request's cache and put it back at the head of the queue, to be recomputed."""
        num_running = len(self.running)
        self.running.remove(request)
        self.cache.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.waiting.appendleft(request)
        self.num_preemptions += 1
        now = time.monotonic()
        if now - self._last_preemption_warning >= PREEMPTION_WARNING_INTERVAL_S:
            self._last_preemption_warning = now
            pool = self.cache.block_pool
            logger.warning("request %s was preempted (its tokens are computed again later): the KV pool's %d "
                           "blocks of %d tokens were all in use by %d running requests (preemptions so far: %d). For "
                           "more KV: --kv-cache-dtype fp8, a higher --gpu-memory-utilization, or a lower "
                           "--max-num-seqs (docs/memory.md)", request.request_id, pool.num_blocks - 1,
                           pool.block_size, num_running, self.num_preemptions)

    # -- one step ------------------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        max_rows = self._micro_batch_rows()
        chosen: list[tuple[Request, int]] = []
        restores: list[tuple[int, int]] = []
        preempted = False
        in_flight = self._in_flight

        # 1. Running requests, oldest first; make room by preempting the newest ones (not one in flight).
        index = 0
        while index < len(self.running) and budget > 0 and len(chosen) < max_rows:
            request = self.running[index]
            if request.reached_limit(self.max_model_len) or request in in_flight:
                # its last token is pending (it finishes when that step's output is processed), or it is in a
                # micro-batch in flight
                index += 1
                continue
            num_new = self._chunk(request, request.num_computed_tokens, budget)
            while not self.cache.allocate(request, num_new):
                victim = self._victim(index)  # the request itself at worst
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            else:
                chosen.append((request, num_new))
                budget -= num_new
                index += 1

        # 2. Waiting requests, fairly between groups (_next_waiting), unless this step had to preempt (no room to grow).
        running_per_group = Counter(request.group for request in self.running) if self.waiting else Counter()
        while (self.waiting and not preempted and budget > 0 and len(self.running) < self.max_num_seqs
               and len(chosen) < max_rows):
            position = self._next_waiting(running_per_group)
            request = self.waiting[position]
            hit = self.cache.find_hit(request)
            num_new = self._chunk(request, hit.num_tokens, budget)
            if not self.cache.admit(request, num_new, hit):
                break  # a request later in the order never overtakes one that does not fit
            if hit.checkpoint_slot is not None:
                restores.append((hit.checkpoint_slot, request.state_slot))
            del self.waiting[position]
            running_per_group[request.group] += 1
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            chosen.append((request, num_new))
            budget -= num_new

        # 3. Checkpoint saves, once every request has its room (a save may evict an older checkpoint; that is
        # safe even if this step restores from it: restores run before the forward, saves after it).
        planned = [self.cache.plan_saves(request, num_new) for request, num_new in chosen]
        saves = [(working, slot) for (_, num_new), plan in zip(chosen, planned)
                 for working, slot, offset in plan if offset == num_new]
        rows = [self._row(request, num_new, next(((offset, slot) for _, slot, offset in plan if offset < num_new),
                                                 None))
                for (request, num_new), plan in zip(chosen, planned)]
        # 4. The step is as good as done for the scheduler: the next one continues after it (async scheduling
        # schedules it before this one's output is back; a sample still on the device counts as pending).
        for (request, num_new), row in zip(chosen, rows):
            request.num_computed_tokens += num_new
            request.num_pending_tokens += row.sample
        if self.num_micro_batches > 1:
            in_flight.update(request for request, _ in chosen)
        finished = []
        if rows:  # an empty step is not launched: its finished ids wait for the next one
            finished, self._finished_ids = self._finished_ids, []
        return SchedulerOutput(rows, restores, saves, finished)

    def _victim(self, first: int) -> Request:
        """The running request to preempt when running[first] cannot grow: one of running[first:] (those before
        it already have their room this step) not in a micro-batch in flight, the newest of the group with the
        most sequences running. So a client request's many sequences give up their cache before another
        client's one does (newest first when every group runs as many, e.g. one sequence each)."""
        candidates = [request for request in self.running[first:] if request not in self._in_flight]
        running_per_group = Counter(request.group for request in self.running)
        most = max(running_per_group[request.group] for request in candidates)
        return next(request for request in reversed(candidates) if running_per_group[request.group] == most)

    def _micro_batch_rows(self) -> int:
        """The most sequences one step may take: all of them with one micro-batch; with several, an even share
        of the live ones (running and waiting, up to max_num_seqs), so that every step in flight has work."""
        if self.num_micro_batches == 1:
            return self.max_num_seqs
        live = min(len(self.running) + len(self.waiting), self.max_num_seqs)
        return max(1, -(-live // self.num_micro_batches))

    def _next_waiting(self, running_per_group: Counter) -> int:
        """Position in `waiting` of the request to admit next: the first one of the group with the fewest sequences
        running. One client request's many sequences (n, a batch of prompts) then take turns with other clients'
        instead of all going first: a request arriving behind a thousand sequences of another waits for one seat
        to free, not for the thousand. Requests of one group, and groups with as many running, go in arrival order
        (a preempted request is back at the head); with one sequence per group this is FCFS."""
        best, best_running, seen = 0, None, set()
        for position, request in enumerate(self.waiting):
            if request.group in seen:
                continue
            running = running_per_group[request.group]
            if running == 0:
                return position  # none has fewer; the earliest such
            seen.add(request.group)
            if best_running is None or running < best_running:
                best, best_running = position, running
        return best

    def _chunk(self, request: Request, start: int, budget: int) -> int:
        """Tokens to compute this step from `start`: the rest, within the budget, cut at a checkpoint target."""
        return self.cache.cut_chunk(request, start, min(request.num_tokens - start, budget))

    @staticmethod
    def _row(request: Request, num_new: int, mid_save: tuple[int, int] | None) -> ScheduledSequence:
        start = request.num_computed_tokens
        token_ids = request.all_token_ids[start:start + num_new]
        pending_input = len(token_ids) < num_new  # the last token is a sample of the step in flight
        return ScheduledSequence(
            request_id=request.request_id,
            serial=request.serial,
            token_ids=token_ids + [-1] if pending_input else token_ids,
            pending_input=pending_input,
            num_computed=start,
            block_ids=request.block_ids,
            state_slot=request.state_slot,
            mid_save=mid_save,
            sample=start + num_new == request.num_tokens,
            params=request.params,
            seed=request.seed,
            prompt_token_ids=request.prompt_token_ids,
            # read by the sampler for penalties and min_tokens only: a copy of a long output for every row of every
            # step would cost O(length) host time a step
            output_token_ids=request.output_token_ids if _samples_from_history(request) else [],
            eos_token_ids=request.eos_token_ids,
            grammar=request.grammar,
        )

    def update_from_output(self, scheduled: SchedulerOutput, output: ModelOutput) -> list[Request]:
        """Take in a step's samples (resolving pending tokens), index the newly computed blocks and
        checkpoints, finish the requests that are done.

        Returns the requests that got a new token this step (finished ones have a finished status).
        """
        updated = []
        for row in scheduled.sequences:
            request = self._request_of(row)
            if request is not None and self._in_flight:
                self._in_flight.discard(request)  # its next step may be scheduled (micro-batches)
            if request is None or request.status.finished or not row.sample:
                continue  # aborted or finished while the step ran, or a prefill chunk short of the end
            request.num_pending_tokens -= 1
            request.append_token(output.sampled[row.request_id])
            updated.append(request)
        self.cache.commit_checkpoints()  # the step's saves are written (or ordered before any reader)
        for request in updated:
            self.cache.cache_full_blocks(request)
            status = request.check_stop(self.max_model_len)
            if status is not None:
                self._finish(request, status)
        for row in scheduled.sequences:
            request = self._request_of(row)
            if request is not None and not row.sample:
                self.cache.cache_full_blocks(request)
        return updated

    def release(self, scheduled: SchedulerOutput) -> None:
        """A step whose output will never be taken in: its sequences may be scheduled again (micro-batches)."""
        for row in scheduled.sequences:
            request = self._request_of(row)
            if request is not None:
                self._in_flight.discard(request)

    def _request_of(self, row: ScheduledSequence) -> Request | None:
        """The live request a step's row was scheduled for; None once it is gone, even if a new request has
        taken its id since (the row's sample is not the newcomer's)."""
        request = self.requests.get(row.request_id)
        return request if request is not None and request.serial == row.serial else None
