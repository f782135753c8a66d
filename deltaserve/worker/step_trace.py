"""Timelines of the steps, for seeing where serving time goes. With DELTASERVE_STEP_TRACE set to a directory:
- every worker of -tp / -pp appends one line per step to `rank<N>.tsv` there: the step's index (the same step has
  the same index on every rank, steps reach every rank in one order), then when the rank began and finished it;
- the engine appends one line per launched step to `engine.tsv`: the index, when it was launched, its rows, its
  tokens (a decode row is one token; more tokens than rows is a step with a prefill chunk) and how long its launch
  took on the host (preparing the inputs and enqueuing the forward, before the launch time). Under async scheduling a
  step is launched once the one before the previous is read back, so over many steps the gaps between launches are
  the steps' device times (`benchmarks/step_trace_summary.py` sums them by kind);
- and one line per step read back to `engine_collect.tsv`: the index, when the read-back began and when it returned.
  The host blocked that long on the device: a step whose read-back waits is bound by the device, one whose
  read-back returns at once by the host;
- the server (server/async_engine.py) appends one line per request to `requests.tsv` when its first output reaches
  its handler: when the handler queued it for the engine, when the engine thread added it, when a step's outputs
  held its first token, and when the handler got them. Against a client's TTFT this places a request's time in
  the server (before the queue: HTTP, parsing, tokenizing; then the engine; then the hand-back).
Times are nanoseconds of CLOCK_MONOTONIC (one clock for every process of the machine)."""

from __future__ import annotations

import os
import time
from pathlib import Path

ENV_VAR = "DELTASERVE_STEP_TRACE"


class StepTrace:
    def __init__(self, path: Path):
        self._file = path.open("a", buffering=1)  # line-buffered: a line is complete once written
        self._index = 0
        self._started = 0

    @classmethod
    def from_env(cls, rank: int) -> StepTrace | None:
        folder = os.environ.get(ENV_VAR)
        return cls(Path(folder) / f"rank{rank}.tsv") if folder else None

    def begin(self) -> None:
        self._started = time.monotonic_ns()

    def end(self) -> None:
        self._file.write(f"{self._index}\t{self._started}\t{time.monotonic_ns()}\n")
        self._index += 1


class EngineTrace:
    """The engine's line per launched step (`engine.tsv`: index, launch time, rows, tokens, host ns of the launch)
    and per step read back (`engine_collect.tsv`: index, read-back began, returned)."""

    def __init__(self, folder: Path):
        self._file = (folder / "engine.tsv").open("a", buffering=1)
        self._collect_file = (folder / "engine_collect.tsv").open("a", buffering=1)
        self._index = 0
        self._indices: dict[int, int] = {}  # id of a launched step not read back yet -> its index

    @classmethod
    def from_env(cls) -> EngineTrace | None:
        folder = os.environ.get(ENV_VAR)
        return cls(Path(folder)) if folder else None

    def launched(self, step: object, rows: int, tokens: int, began_ns: int) -> None:
        """`step` was launched from began_ns (on the host) until now."""
        self._indices[id(step)] = self._index
        now = time.monotonic_ns()
        self._file.write(f"{self._index}\t{now}\t{rows}\t{tokens}\t{now - began_ns}\n")
        self._index += 1

    def collected(self, step: object, began_ns: int) -> None:
        """`step` (as passed to launched) was read back from began_ns until now."""
        index = self._indices.pop(id(step), None)
        if index is not None:
            self._collect_file.write(f"{index}\t{began_ns}\t{time.monotonic_ns()}\n")


class RequestTrace:
    """The server's line per request (`requests.tsv`: queued, added, first token, delivered; ns)."""

    def __init__(self, folder: Path):
        self._file = (folder / "requests.tsv").open("a", buffering=1)

    @classmethod
    def from_env(cls) -> RequestTrace | None:
        folder = os.environ.get(ENV_VAR)
        return cls(Path(folder)) if folder else None

    def first_output(self, queued_ns: int, added_ns: int, first_token_ns: int) -> None:
        """A request's first output reached its handler now."""
        self._file.write(f"{queued_ns}\t{added_ns}\t{first_token_ns}\t{time.monotonic_ns()}\n")


def read_requests(folder: Path) -> list[tuple[int, int, int, int]]:
    """The server's (queued, added, first token, delivered) ns per request, by queue time; [] without the file."""
    path = Path(folder) / "requests.tsv"
    if not path.exists():
        return []
    return sorted(tuple(int(field) for field in line.split("\t")) for line in path.read_text().splitlines())


def read_engine(folder: Path) -> list[tuple[int, int, int]]:
    """The engine's (launched, rows, tokens) per step, in step order (a step's index is its position)."""
    lines = (Path(folder) / "engine.tsv").read_text().splitlines()
    return [(int(at), int(rows), int(tokens)) for _, at, rows, tokens, *_ in (line.split("\t") for line in lines)]


def read_launch_host_ns(folder: Path) -> list[int]:
    """How long each step's launch took on the host, in step order."""
    lines = (Path(folder) / "engine.tsv").read_text().splitlines()
    return [int(line.split("\t")[4]) for line in lines]


def read_collects(folder: Path) -> dict[int, tuple[int, int]]:
    """The engine's step index -> (read-back began, returned) ns; empty for a trace without the file."""
    path = Path(folder) / "engine_collect.tsv"
    if not path.exists():
        return {}
    lines = path.read_text().splitlines()
    return {int(index): (int(began), int(ended)) for index, began, ended in (line.split("\t") for line in lines)}


def read(folder: Path, rank: int) -> list[tuple[int, int]]:
    """One rank's (began, finished) per step, in step order."""
    lines = (Path(folder) / f"rank{rank}.tsv").read_text().splitlines()
    return [(int(began), int(finished)) for _, began, finished in (line.split("\t") for line in lines)]
