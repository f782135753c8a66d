"""Sampling parameters: `SamplingParams` mirrors vLLM's (same field names and defaults) and validates itself on
construction; the batched sampler that applies them is worker/sampler.py. No torch here: the scheduler, the
request and the server read these.
"""

from __future__ import annotations

import enum
import math
import numbers
from dataclasses import dataclass, field

from deltaserve.structured.params import StructuredOutputsParams

_GREEDY_TEMPERATURE = 1e-5  # below this a temperature is treated as 0, i.e. greedy (as vLLM does)
_MAX_LOGPROBS = 20  # the OpenAI API's limit on top logprobs
# Seeds are int64, as in vLLM's API; each maps to its own torch seed (worker/sampler.make_generator), none is
# folded onto another
_SEED_RANGE = (-2**63, 2**63)


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_finite_real(value) -> bool:
    """A real number that is neither inf nor NaN, nor an int too large for a float."""
    try:
        return _is_real(value) and math.isfinite(value)
    except OverflowError:
        return False


def _require(ok: bool, name: str, value, requirement: str) -> None:
    if not ok:
        raise ValueError(f"{name} must be {requirement}, got {value!r}")


class RequestOutputKind(enum.Enum):
    """What each of a request's RequestOutputs carries (vLLM's enum of the same name)."""

    CUMULATIVE = 0  # every step: all text, token ids and logprobs so far (O(length) a step to build)
    DELTA = 1  # every step: only what is new since the request's previous output (the server streams these)
    FINAL_ONLY = 2  # one output, when the request finishes, with everything (LLM.generate)


@dataclass
class SamplingParams:
    """How to sample one request's output; field names and defaults follow vLLM."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the context limit (the engine fills it in)
    min_tokens: int = 0
    stop: str | list[str] | None = None  # normalised to a list by __post_init__
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs to return besides the sampled token's
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None  # a grammar the output must match

    def __post_init__(self) -> None:
        _require(isinstance(self.output_kind, RequestOutputKind), "output_kind", self.output_kind,
                 f"a RequestOutputKind ({', '.join(kind.name for kind in RequestOutputKind)})")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            value = getattr(self, name)
            _require(_is_finite_real(value), name, value, "a finite number")
            setattr(self, name, float(value))
        for name in ("n", "top_k", "min_tokens"):
            _require(_is_int(getattr(self, name)), name, getattr(self, name), "an integer")
        for name in ("seed", "max_tokens", "logprobs"):
            value = getattr(self, name)
            _require(value is None or _is_int(value), name, value, "an integer or None")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            _require(isinstance(getattr(self, name), bool), name, getattr(self, name), "a bool")

        # Written as `not (x >= lo)` so that NaN fails too.
        _require(self.n >= 1, "n", self.n, ">= 1")
        _require(self.temperature >= 0, "temperature", self.temperature, ">= 0")
        _require(0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1]")
        _require(self.top_k in (-1, 0) or self.top_k >= 1, "top_k", self.top_k, "-1, 0 (disabled) or >= 1")
        _require(0 <= self.min_p <= 1, "min_p", self.min_p, "in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            _require(-2 <= getattr(self, name) <= 2, name, getattr(self, name), "in [-2, 2]")
        _require(self.repetition_penalty > 0, "repetition_penalty", self.repetition_penalty, "> 0")
        _require(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", self.max_tokens,
                 ">= 1 or None")
        _require(self.min_tokens >= 0, "min_tokens", self.min_tokens, ">= 0")
        if self.max_tokens is not None:
            _require(self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens,
                     f"<= max_tokens ({self.max_tokens})")
        if self.seed is not None:
            _require(_SEED_RANGE[0] <= self.seed < _SEED_RANGE[1], "seed", self.seed,
                     "in [-2**63, 2**63) (vLLM's range)")
        if self.logprobs is not None:
            _require(0 <= self.logprobs <= _MAX_LOGPROBS, "logprobs", self.logprobs,
                     f"in [0, {_MAX_LOGPROBS}]")

        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        _require(isinstance(self.stop, (list, tuple)), "stop", self.stop,
                 "a string, a list of strings or None")
        self.stop = list(self.stop)
        for text in self.stop:
            _require(isinstance(text, str) and text != "", "stop", self.stop, "a list of non-empty strings")

        if self.stop_token_ids is None:
            self.stop_token_ids = []
        _require(isinstance(self.stop_token_ids, (list, tuple)), "stop_token_ids", self.stop_token_ids,
                 "a list of token ids")
        self.stop_token_ids = list(self.stop_token_ids)
        for token in self.stop_token_ids:
            _require(_is_int(token) and token >= 0, "stop_token_ids", self.stop_token_ids,
                     "a list of integers >= 0")
        if self.structured_outputs is not None:
            _require(isinstance(self.structured_outputs, StructuredOutputsParams), "structured_outputs",
                     self.structured_outputs, "a StructuredOutputsParams or None")
            # the grammar decides where the output may end; a minimum that forbids its stop token could leave
            # no token to sample
            _require(self.min_tokens == 0, "min_tokens", self.min_tokens, "0 with structured_outputs")

    @property
    def has_penalties(self) -> bool:
        """A repetition, frequency or presence penalty is set: sampling reads the output tokens."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def greedy(self) -> bool:
        """True when the token is the argmax (temperature 0 or too small to divide by safely)."""
        return self.temperature < _GREEDY_TEMPERATURE
