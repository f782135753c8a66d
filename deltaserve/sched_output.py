"""The CPU -> GPU contract: what the scheduler asks the runner to compute, and what comes back.

Below both the scheduler and the model runner, so neither imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deltaserve.sampling import SamplingParams


@dataclass
class ScheduledSequence:
    """One row of a step: feed `token_ids` at positions num_computed.. and maybe sample after them."""

    request_id: str
    serial: int  # the request's Request.serial: another request may reuse the id once this one finishes
    token_ids: list[int]  # the new tokens of this step (-1 for a pending one, see pending_input)
    # async scheduling: the last new token is the sample of the step still in flight, only on the device yet
    pending_input: bool
    num_computed: int  # tokens already in the KV cache / state before this step
    block_ids: list[int]  # every KV block of the request, in order
    state_slot: int  # GDN working slot
    # (offset, checkpoint slot): copy the GDN state after the first `offset` new tokens there, inside the step
    mid_save: tuple[int, int] | None
    sample: bool  # this chunk reaches the end of the known tokens: sample the next one
    params: SamplingParams
    seed: int | None  # the request's sampling seed (Request.seed): the runner keeps its generator
    prompt_token_ids: list[int]  # for the repetition penalty (shared lists: read, never written)
    output_token_ids: list[int]  # for the penalties and min_tokens; [] for a request that uses neither
    eos_token_ids: set[int]
    grammar: object | None = None  # the request's GrammarState (structured output): its sample waits for a mask


@dataclass
class SchedulerOutput:
    sequences: list[ScheduledSequence] = field(default_factory=list)
    # GDN state slot copies (src, dst), applied to every GDN layer's conv and recurrent pools:
    state_restores: list[tuple[int, int]] = field(default_factory=list)  # checkpoint -> working, BEFORE the forward
    state_saves: list[tuple[int, int]] = field(default_factory=list)  # working -> new checkpoint, AFTER the forward
    # requests finished or aborted since the previous launched step: the runner drops their generators
    finished_request_ids: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.sequences)

    @property
    def is_empty(self) -> bool:
        return not self.sequences


@dataclass
class ModelOutput:
    """Sampled tokens for the rows of a step that asked to sample (others get nothing)."""

    sampled: dict[str, int]  # request_id -> token id
    logprobs: dict[str, float]  # request_id -> logprob of the sampled token
    top_logprobs: dict[str, list[tuple[int, float]]]  # request_id -> top (token, logprob), when asked
