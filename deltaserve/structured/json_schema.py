"""JSON schemas as xgrammar 0.2.9 needs them to give output that validates.

- A string's minLength/maxLength (without a pattern) compiles to a character class that admits raw control
  characters, which JSON forbids, and no escapes (xgrammar issue 800). The same bounds written as a pattern,
  `^[\\s\\S]{min,max}$`, take xgrammar's JSON-string-aware path: never invalid JSON (still no escapes in such a
  string, a limit of that path). `rewrite_lengths` makes that change; JSON Schema applies both forms to strings
  only, so they mean the same.
- Some keywords compile but are not enforced, so the output could break them: uniqueItems, not, if/then/else,
  dependentRequired, dependentSchemas, allOf of several schemas, and minLength/maxLength beside a pattern or a
  format. A schema using one is refused (GrammarError naming the keyword and where it is), rather than served
  output that might not validate.
"""

from __future__ import annotations

from typing import Any

from deltaserve.structured.params import GrammarError

# keys whose values are instances (data), not schemas: never rewritten or checked
_DATA_KEYS = frozenset({"enum", "const", "default", "examples"})
# keys whose values map names to schemas (the map itself is not a schema)
_MAP_KEYS = frozenset({"properties", "patternProperties", "$defs", "definitions"})
_UNENFORCED = ("uniqueItems", "not", "if", "dependentRequired", "dependentSchemas")


def prepare_schema(schema: Any, field: str = "json", rewrite_lengths: bool = True) -> Any:
    """A copy of `schema` that xgrammar enforces as written (see the module docstring); GrammarError(field, ...)
    for a keyword it would not enforce."""
    return _prepare(schema, [], field, rewrite_lengths)


def _prepare(node: Any, path: list[str], field: str, rewrite: bool) -> Any:
    if isinstance(node, list):
        return [_prepare(item, path + [str(i)], field, rewrite) for i, item in enumerate(node)]
    if not isinstance(node, dict):
        return node
    _check(node, path, field)
    out = {}
    for key, value in node.items():
        if key in _DATA_KEYS:
            out[key] = value
        elif key in _MAP_KEYS and isinstance(value, dict):
            out[key] = {name: _prepare(sub, path + [key, name], field, rewrite) for name, sub in value.items()}
        else:
            out[key] = _prepare(value, path + [key], field, rewrite)
    low, high = out.get("minLength"), out.get("maxLength")
    bounds = [v for v in (low, high) if isinstance(v, int) and not isinstance(v, bool)]
    if rewrite and bounds and "pattern" not in out and "format" not in out:
        out.pop("minLength", None)
        out.pop("maxLength", None)
        out["pattern"] = f"^[\\s\\S]{{{low if isinstance(low, int) else 0},{high if isinstance(high, int) else ''}}}$"
    return out


def _check(node: dict, path: list[str], field: str) -> None:
    where = f" (at {'.'.join(path)})" if path else ""
    for key in _UNENFORCED:
        if key in node and not (key == "uniqueItems" and node[key] is False):
            raise GrammarError(field, f"xgrammar cannot enforce {key!r}{where}: the output could break it")
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        raise GrammarError(field, f"xgrammar cannot enforce 'allOf' of several schemas{where}; merge them")
    lengths = [key for key in ("minLength", "maxLength") if isinstance(node.get(key), int)]
    other = next((key for key in ("pattern", "format") if key in node), None)
    if lengths and other is not None:
        raise GrammarError(field, f"xgrammar cannot enforce {lengths[0]!r} beside {other!r}{where}; fold the length "
                                  "into the pattern")
