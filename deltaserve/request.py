"""Request: one sequence being generated, as the scheduler and the cache managers see it."""

from __future__ import annotations

import enum
import itertools
import time

from deltaserve.sampling import SamplingParams

_SERIALS = itertools.count()  # Request.serial


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


class Request:
    """Token ids so far and how many of them are in the cache.

    Invariant: 0 <= num_computed_tokens <= num_tokens. The request needs a forward pass over its tokens
    from num_computed_tokens on; when that pass reaches num_tokens a new token is sampled. The scheduler
    advances num_computed_tokens when it schedules a step. With async scheduling a sampled token may still
    be on the device, known to the CPU only as a count (num_pending_tokens): such tokens are part of
    num_tokens but not of all_token_ids until the step's output is processed.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, max_tokens: int,
                 eos_token_ids: set[int], arrival_time: float | None = None, group: str | None = None):
        self.request_id = request_id
        # the client request this sequence belongs to (its n choices, its batch of prompts): the scheduler admits
        # fairly between groups (scheduler.py)
        self.group = request_id if group is None else group
        # unique in the process: a step still in flight for a finished request must not feed a new request
        # that reuses its id (async scheduling processes a step's samples after the next step is scheduled)
        self.serial = next(_SERIALS)
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.max_tokens = max_tokens  # resolved: params.max_tokens capped by the context limit
        self.eos_token_ids = eos_token_ids if not params.ignore_eos else set()
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.all_token_ids = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_pending_tokens = 0  # sampled by steps still in flight; not in all_token_ids yet
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at the first schedule
        self.block_ids: list[int] = []
        self.state_slot: int | None = None
        # Prefix caching (cache/cache_manager.py); untouched when it is off.
        self.block_hashes: list[bytes] = []  # chain hash of each full block of all_token_ids
        self.num_indexed_blocks = 0  # block_ids[:n] are in the prefix index (or duplicate an indexed block)
        self.checkpoint_targets: list[int] = []  # prefill lengths where a state checkpoint is to be saved
        self.last_prompt_boundary = 0  # past this length, block boundaries get the request's decode checkpoint
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        # the seed of this sequence's own generator (the runner holds it): seeded sampling is reproducible
        # whatever else shares the batch; None samples from the global RNG
        self.seed: int | None = None
        # structured output: the sequence's structured.matcher.GrammarState (opaque here: the scheduler only
        # hands it to the step's rows; the engine advances it with each resolved token)
        self.grammar = None

    @property
    def num_tokens(self) -> int:
        """Tokens so far, the pending ones included."""
        return len(self.all_token_ids) + self.num_pending_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids):]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    @property
    def needs_host_history(self) -> bool:
        """Sampling this request's next token reads its output tokens on the host (penalties, min_tokens), so
        no sample of it may still be pending on the device."""
        return self.params.has_penalties or self.num_output_tokens < self.params.min_tokens

    def reached_limit(self, max_model_len: int) -> bool:
        """Counting pending tokens, the request has all the tokens it may have: it needs no further step."""
        num_outputs = self.num_tokens - len(self.prompt_token_ids)
        return num_outputs >= self.max_tokens or self.num_tokens >= max_model_len

    def check_stop(self, max_model_len: int) -> RequestStatus | None:
        """The finishing status after the last appended token, or None to continue."""
        last = self.all_token_ids[-1]
        stop_token = last in self.eos_token_ids or last in self.params.stop_token_ids
        if stop_token and self.num_output_tokens >= self.params.min_tokens:
            self.stop_reason = None if last in self.eos_token_ids else last
            return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= self.max_tokens or len(self.all_token_ids) >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
