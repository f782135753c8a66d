"""The scheduler: one rule, no prefill/decode phases.

Each step, every request's num_computed_tokens catches up with its num_tokens inside one token budget
(max_num_batched_tokens): running requests first (in arrival order), then waiting ones (FCFS) while at
most max_num_seqs run. A prompt longer than the remaining budget is cut into chunks (chunked prefill), and
prefill chunks share the step with decode tokens. When KV blocks or state slots run out, the newest
running request is preempted: its cache is freed and it is recomputed later from its tokens, so nothing
is dropped and greedy output is unchanged.

Mixed steps (opt-in: DELTASERVE_MIXED_CHUNK_TOKENS, see cache/footprint.py): when most running requests decode
(MIXED_MIN_DECODES to MIXED_MAX_DECODES of them, and at least MIXED_DECODE_SHARE of the requests with work), a
step carries at most `mixed_chunk_tokens` prompt tokens, in one chunk, after its decode rows, and the runner
replays it as one CUDA graph (worker/cuda_graph.py). Such a chunk is cut at a checkpoint target rather than
saving the state inside the step. With fewer decoding requests (a burst of new prompts) or more (past the batch
size where the weights stop dominating a step), the budget alone decides.

With prefix caching on, a waiting request starts at its prefix hit (cached KV blocks plus a GDN state
checkpoint, copied into its working slot before the forward: `state_restores`), and prefill chunks are cut
where a checkpoint belongs, so that the runner can copy the state out after the forward (`state_saves`),
except where the checkpoint is within a block of the chunk's end (every prompt's end): the row then carries
`mid_save` and the GDN layers copy the state out inside the step. See cache/kv_manager.py for where
checkpoints go.
"""

from __future__ import annotations

from collections import deque

from deltaserve.cache.footprint import MIXED_MAX_DECODES, MIXED_MIN_DECODES
from deltaserve.cache.kv_manager import CacheManager
from deltaserve.request import Request, RequestStatus
from deltaserve.sched_output import ModelOutput, ScheduledSequence, SchedulerOutput


# Share of the requests with work (decoding, prefilling, or waiting with a free seat) that must be decoding for
# prompt tokens to join steps as one capped chunk.
MIXED_DECODE_SHARE = 0.75


def _samples_from_history(request: Request) -> bool:
    """Whether the sampler reads this request's output tokens: penalties, or min_tokens (its length)."""
    return request.params.has_penalties or request.params.min_tokens > 0


class Scheduler:
    def __init__(self, cache: CacheManager, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 mixed_chunk_tokens: int = 0):
        """mixed_chunk_tokens: the prompt tokens a mixed step may carry (0: no mixed steps; see the module)."""
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.mixed_chunk_tokens = mixed_chunk_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}

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
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.cache.free(request)
        self.requests.pop(request.request_id, None)

    def _preempt(self, request: Request) -> None:
        """Free the request's cache and put it back at the head of the queue, to be recomputed."""
        self.running.remove(request)
        self.cache.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    # -- one step ------------------------------------------------------------------------------------------

    @staticmethod
    def _decoding(request: Request) -> bool:
        """Its next step is one token after cached state."""
        return request.num_computed_tokens > 0 and request.num_tokens - request.num_computed_tokens == 1

    def _mixed_chunk_cap(self) -> int | None:
        """The prompt tokens this step may carry as one chunk beside its decodes, or None (no cap); see the
        module docstring."""
        if not self.mixed_chunk_tokens:
            return None
        decoding = sum(map(self._decoding, self.running))
        seats = max(0, self.max_num_seqs - len(self.running))
        with_work = len(self.running) + min(len(self.waiting), seats)
        if MIXED_MIN_DECODES <= decoding <= MIXED_MAX_DECODES and decoding >= MIXED_DECODE_SHARE * with_work:
            return self.mixed_chunk_tokens
        return None

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        chosen: list[tuple[Request, int]] = []
        restores: list[tuple[int, int]] = []
        preempted = False
        cap = self._mixed_chunk_cap()
        prompt_rows_left = 1 if cap is not None else len(self.running) + len(self.waiting)

        # 1. Running requests, oldest first; make room by preempting the newest ones.
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if request.reached_limit(self.max_model_len):
                index += 1  # its last token is pending: it finishes when that step's output is processed
                continue
            decoding = self._decoding(request)
            if not decoding and not prompt_rows_left:
                index += 1  # a capped step's prompt chunk is taken: this prompt goes on next step
                continue
            num_new = self._chunk(request, request.num_computed_tokens, budget, cap)
            while not self.cache.allocate(request, num_new):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            else:
                chosen.append((request, num_new))
                budget -= num_new
                prompt_rows_left -= not decoding
                index += 1

        # 2. Waiting requests in arrival order, unless this step had to preempt (no room to grow).
        while (self.waiting and not preempted and budget > 0 and len(self.running) < self.max_num_seqs
               and prompt_rows_left):
            request = self.waiting[0]
            hit = self.cache.find_hit(request)
            num_new = self._chunk(request, hit.num_tokens, budget, cap)
            if not self.cache.admit(request, num_new, hit):
                break  # FCFS: a later request never overtakes one that does not fit
            if hit.checkpoint_slot is not None:
                restores.append((hit.checkpoint_slot, request.state_slot))
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            chosen.append((request, num_new))
            budget -= num_new
            prompt_rows_left -= 1
        if cap is not None:  # the mixed layout: decode rows first, the prompt chunk last
            chosen.sort(key=lambda choice: not self._decoding(choice[0]))

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
        return SchedulerOutput(rows, restores, saves)

    def _chunk(self, request: Request, start: int, budget: int, cap: int | None) -> int:
        """Tokens to compute this step from `start`: the rest, within the budget (and a mixed step's cap), cut
        at a checkpoint target (a capped chunk also where the state would otherwise be saved inside the step)."""
        num_new = min(request.num_tokens - start, budget, cap or budget)
        return self.cache.cut_chunk(request, start, num_new, save_inside=cap is None)

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
            generator=request.generator,
            prompt_token_ids=request.prompt_token_ids,
            # read by the sampler for penalties and min_tokens only: a copy of a long output for every row of every
            # step would cost O(length) a step (~40 us at 16K tokens, on the host)
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

    def _request_of(self, row: ScheduledSequence) -> Request | None:
        """The live request a step's row was scheduled for; None once it is gone, even if a new request has
        taken its id since (the row's sample is not the newcomer's)."""
        request = self.requests.get(row.request_id)
        return request if request is not None and request.serial == row.serial else None
