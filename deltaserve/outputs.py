"""What the engine returns: vLLM-shaped RequestOutput / CompletionOutput.

Cumulative (all so far) or deltas (what is new since the request's previous output), as the request's
`SamplingParams.output_kind` asks; `OutputAccumulator` joins deltas back into one cumulative output.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1-based rank in the distribution; None when unknown
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None  # per output token: sampled token + top alternatives
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)


class OutputAccumulator:
    """Joins a request's delta outputs, in order, into the cumulative output they add up to. Each add is
    O(its own size): text is kept as pieces and joined once, by `result()`."""

    def __init__(self):
        self._last: RequestOutput | None = None
        self._choices: dict[int, tuple[list[str], list[int], list | None]] = {}  # index -> text, ids, logprobs
        self._ends: dict[int, CompletionOutput] = {}  # index -> its latest output (finish, cumulative logprob)

    def add(self, delta: RequestOutput) -> None:
        self._last = delta
        for output in delta.outputs:
            pieces, ids, logprobs = self._choices.setdefault(
                output.index, ([], [], None if output.logprobs is None else []))
            pieces.append(output.text)
            ids.extend(output.token_ids)
            if logprobs is not None and output.logprobs is not None:
                logprobs.extend(output.logprobs)
            self._ends[output.index] = output

    def result(self) -> RequestOutput:
        """The cumulative output (the latest one's request-level fields, each choice's text and tokens joined)."""
        if self._last is None:
            raise ValueError("no output was added")
        outputs = [CompletionOutput(index, "".join(pieces), ids, self._ends[index].cumulative_logprob, logprobs,
                                    self._ends[index].finish_reason, self._ends[index].stop_reason)
                   for index, (pieces, ids, logprobs) in sorted(self._choices.items())]
        last = self._last
        return RequestOutput(last.request_id, last.prompt, last.prompt_token_ids, outputs, last.finished,
                             last.num_cached_tokens, last.metrics)
