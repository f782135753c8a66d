"""JSON parsing with limits, for what clients send (request bodies, and JSON inside their strings, such as a
tool call's `arguments`) and what models write (tool-call arguments).

    loads(text)   json.loads, but raises JSONLimitError (a ValueError) for JSON nested deeper than
                  MAX_JSON_DEPTH, and for an integer longer than Python converts (sys.get_int_max_str_digits,
                  4,300 digits by default), saying where that integer is (`path`, e.g. ("seed",))

The depth bound keeps everything downstream that walks the value recursively (pydantic, Jinja chat templates,
json.dumps) far from Python's recursion limit, and gives the same answer whatever the Python version (3.11's
parser gives up near 1,000 levels, 3.12's goes deeper).
"""

from __future__ import annotations

import json
import sys
from collections import deque
from typing import Any

# Nesting a JSON value may have (OpenAI requests, tool schemas included, nest a few tens of levels; the
# demo chat template recursed past Python's limit on tool-call arguments ~489 levels deep)
MAX_JSON_DEPTH = 256
_TOO_DEEP = f"nested too deeply (more than {MAX_JSON_DEPTH} levels)"


class JSONLimitError(ValueError):
    """JSON this server does not take; `path` locates the offending value when it is known."""

    def __init__(self, message: str, path: tuple = ()):
        super().__init__(message)
        self.path = path


def loads(text: str, allow_constants: bool = True) -> Any:
    """`text` parsed; allow_constants=False refuses Python's NaN / Infinity extension (not JSON).

    Raises JSONLimitError past the limits above, ValueError (json.JSONDecodeError) for malformed JSON.
    """
    parse_constant = None if allow_constants else _reject_constant
    try:
        data = json.loads(text, parse_constant=parse_constant)
    except RecursionError as exc:
        raise JSONLimitError(_TOO_DEEP) from exc
    except ValueError as exc:
        long_integer = _long_integer_error(text, parse_constant)
        if long_integer is None:
            raise
        raise long_integer from exc
    # fewer opening brackets than the limit cannot nest past it: most texts skip the walk
    if text.count("[") + text.count("{") > MAX_JSON_DEPTH and nested_deeper_than(data, MAX_JSON_DEPTH):
        raise JSONLimitError(_TOO_DEEP)
    return data


def nested_deeper_than(data: Any, limit: int) -> bool:
    """Whether parsed JSON nests lists and objects more than `limit` levels deep (iteratively: no recursion)."""
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        for child in _children(value):
            if isinstance(child, (dict, list)):
                if depth + 1 > limit:
                    return True
                stack.append((child, depth + 1))
    return False


def _children(value: Any):
    return value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


class _LongInteger:
    """Stands in for an integer Python would not convert, so that a second parse can say where it is."""

    def __init__(self, num_digits: int):
        self.num_digits = num_digits


def _long_integer_error(text: str, parse_constant) -> JSONLimitError | None:
    """The error for the first too-long integer in `text`, with its path; None if that is not what failed."""
    limit = getattr(sys, "get_int_max_str_digits", lambda: 0)()
    if not limit:
        return None

    def parse_int(digits: str):
        num_digits = len(digits.lstrip("-"))
        return _LongInteger(num_digits) if num_digits > limit else int(digits)

    try:
        data = json.loads(text, parse_int=parse_int, parse_constant=parse_constant)
    except (ValueError, RecursionError):  # malformed for another reason too: the first error stands
        return None
    queue: deque[tuple[tuple, Any]] = deque([((), data)])
    while queue:
        path, value = queue.popleft()
        if isinstance(value, _LongInteger):
            where = ".".join(map(str, path)) or "the value"
            return JSONLimitError(f"{where}: an integer of {value.num_digits:,} digits is longer than this server "
                                  f"reads ({limit:,} digits)", path)
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        queue.extend((path + (key,), child) for key, child in items)
    return None
