"""GrammarState: one sequence's progress through its constraint, and the fill of a step's bitmask.

A state is advanced only by a sequence's resolved tokens (`accept`, after a step's samples are read back), never
by a pending one: preemption by recompute keeps every resolved token, so the state stays right with no rollback.

    reasoning (only with a reasoning_end token): free tokens, counted; at the thinking budget the mask allows
        only reasoning_end; reasoning_end itself ends this phase
    constrained: the xgrammar matcher's mask; a token it refuses, or a mask that allows nothing, ends the
        sequence (`end` says why); so does the grammar's stop token, once accepted
"""

from __future__ import annotations

import torch

from deltaserve.structured.compiler import CompiledConstraint

_batch_matcher = None  # xgrammar.BatchGrammarMatcher: fills many rows with xgrammar's threads


class GrammarState:
    def __init__(self, constraint: CompiledConstraint):
        import xgrammar

        self._matcher = None if constraint.grammar is None else xgrammar.GrammarMatcher(constraint.grammar)
        self._reasoning_end = constraint.reasoning_end_id
        self._budget = constraint.thinking_token_budget
        self.reasoning = self._reasoning_end is not None  # still thinking: no constraint yet
        self.num_reasoning_tokens = 0
        self.end: str | None = None  # why the constraint ended the sequence; None while it may go on
        self.error = False  # the end is a failure (a refused token or a dead end), not a finished grammar

    @property
    def forces_reasoning_end(self) -> bool:
        return self.reasoning and self._budget is not None and self.num_reasoning_tokens >= self._budget

    @property
    def masks(self) -> bool:
        """This sequence's next token is constrained by the grammar's matcher."""
        return not self.reasoning and self._matcher is not None and self.end is None

    def accept(self, token: int) -> None:
        """Advance by a sampled token; sets `end` if the sequence must stop here."""
        if self.end is not None:
            return
        if self.reasoning:
            if token == self._reasoning_end:
                self.reasoning = False
            else:
                self.num_reasoning_tokens += 1
            return
        if self._matcher is None:
            return
        if not self._matcher.accept_token(token):
            self._fail(f"the grammar refused token {token}")
        elif self._matcher.is_terminated():
            self.end = "the grammar is complete"

    def _fail(self, reason: str) -> None:
        self.end, self.error = reason, True


def fill_bitmask(states: list[tuple[int, GrammarState]], bitmask: torch.Tensor) -> list[int]:
    """Write the next-token mask of each (row, state) into bitmask[row] ([R, ceil(V/32)] int32 on the host; bit t
    set: token t allowed) and return the rows that carry a mask. A state whose mask allows no token gets `end`
    set and its row is left out (its sequence is to stop; the engine finishes it)."""
    global _batch_matcher
    grammar_rows = [(row, state) for row, state in states if state.masks]
    forced = [(row, state) for row, state in states if state.forces_reasoning_end]
    if len(grammar_rows) == 1:
        row, state = grammar_rows[0]
        state._matcher.fill_next_token_bitmask(bitmask, row)
    elif grammar_rows:
        import xgrammar

        if _batch_matcher is None:
            _batch_matcher = xgrammar.BatchGrammarMatcher()
        _batch_matcher.batch_fill_next_token_bitmask([s._matcher for _, s in grammar_rows], bitmask,
                                                     [row for row, _ in grammar_rows])
    rows = []
    if grammar_rows:  # numpy: a host-side check, never worth torch's thread pool
        allowed_any = bitmask.numpy()[[row for row, _ in grammar_rows]].any(axis=1).tolist()
        for (row, state), ok in zip(grammar_rows, allowed_any):
            if ok:
                rows.append(row)
            else:
                state._fail("no token can continue the grammar")
    for row, state in forced:
        token = state._reasoning_end
        words = bitmask.numpy()[row]
        words[:] = 0
        words[token // 32] = _bit(token % 32)
        rows.append(row)
    return sorted(rows)


def _bit(position: int) -> int:
    """The int32 whose bit `position` alone is set (bit 31 is the sign bit)."""
    return (1 << position) - (1 << 32 if position == 31 else 0)
