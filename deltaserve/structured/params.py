"""StructuredOutputsParams: the constraint a request's output must match, checked for shape on construction.

Field names follow vLLM's `StructuredOutputsParams` (json, regex, choice, grammar, json_object, structural_tag,
disable_any_whitespace, disable_additional_properties); exactly one constraint is set. Whether a schema, regex
or grammar is valid is decided when it is compiled (compiler.py), which names what is wrong with it.

Two deltaserve fields serve reasoning models: `reasoning_end` (a token, such as "</think>") makes the constraint
apply only after the model has written it, so the thinking before it is free; `thinking_token_budget` forces
that token once the thinking has taken that many tokens. With `reasoning_end` set, no constraint is needed: the
budget alone then bounds the thinking, and the answer after it is free.
"""

from __future__ import annotations

from dataclasses import dataclass

CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


class GrammarError(ValueError):
    """A constraint that cannot be compiled (or enforced); `field` names the StructuredOutputsParams field, `reason`
    says why."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | dict | bool | None = None  # a JSON schema, as a dict (or bool) or its JSON text
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # EBNF (xgrammar's, GBNF-like: `root ::= ...`) or Lark
    json_object: bool | None = None  # any JSON object
    structural_tag: str | dict | None = None  # xgrammar's structural tag: {"type": "structural_tag", "format": ...}
    disable_any_whitespace: bool = False  # JSON: no whitespace but ", " and ": " between items
    disable_additional_properties: bool = False  # JSON: always so here (xgrammar's strict mode)
    reasoning_end: str | None = None  # the constraint starts after this token (see the module docstring)
    thinking_token_budget: int | None = None  # tokens before reasoning_end is forced (needs reasoning_end)

    def __post_init__(self) -> None:
        given = [name for name in CONSTRAINTS if self._set(name)]
        if len(given) > 1:
            raise ValueError(f"structured_outputs takes one constraint, got {given}")
        if not given and self.reasoning_end is None:
            raise ValueError(f"structured_outputs needs one of {list(CONSTRAINTS)}")
        checks = {
            "json": lambda v: isinstance(v, (str, dict, bool)),
            "regex": lambda v: isinstance(v, str),
            "choice": lambda v: isinstance(v, (list, tuple)) and bool(v) and all(isinstance(c, str) for c in v),
            "grammar": lambda v: isinstance(v, str) and v.strip() != "",
            "json_object": lambda v: isinstance(v, bool),
            "structural_tag": lambda v: isinstance(v, (str, dict)),
        }
        wanted = {"json": "a JSON schema (an object, a bool or its JSON text)", "regex": "a string",
                  "choice": "a non-empty list of strings", "grammar": "a non-empty string", "json_object": "a bool",
                  "structural_tag": "an object or its JSON text"}
        for name in given:
            if not checks[name](getattr(self, name)):
                raise ValueError(f"structured_outputs.{name} must be {wanted[name]}, got {getattr(self, name)!r}")
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"structured_outputs.{name} must be a bool, got {getattr(self, name)!r}")
        if self.reasoning_end is not None and not (isinstance(self.reasoning_end, str) and self.reasoning_end):
            raise ValueError(f"structured_outputs.reasoning_end must be a non-empty string, got {self.reasoning_end!r}")
        budget = self.thinking_token_budget
        if budget is not None:
            if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
                raise ValueError(f"thinking_token_budget must be an integer >= 0, got {budget!r}")
            if self.reasoning_end is None:
                raise ValueError("thinking_token_budget needs a reasoning model's end-of-thinking token "
                                 "(the server's --reasoning-parser)")

    def _set(self, name: str) -> bool:
        value = getattr(self, name)
        return value is not None and not (name == "json_object" and value is False)

    @property
    def kind(self) -> str | None:
        """Which constraint is set ("json", "regex", ...), or None (a thinking budget alone)."""
        return next((name for name in CONSTRAINTS if self._set(name)), None)
