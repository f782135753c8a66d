"""Seeded random JSON schemas for structured-output tests: nested objects, enums, arrays, required fields.

Every string, number and array is bounded (maxLength, a range, maxItems), so that a random-weight model, whose
free choice is noise, always reaches the end of the document within a modest token budget: only the grammar
decides what it writes.
"""

import random

_NAMES = ["id", "name", "city", "tags", "count", "ok", "kind", "items", "meta", "score", "note", "level", "user",
          "flag", "code", "size"]


def random_schema(seed: int) -> dict:
    rng = random.Random(seed)
    return _object(rng, depth=0)


def _object(rng: random.Random, depth: int) -> dict:
    names = rng.sample(_NAMES, rng.randint(1, 4))
    properties = {name: _value(rng, depth + 1) for name in names}
    schema = {"type": "object", "properties": properties}
    required = [name for name in names if rng.random() < 0.6]
    if required:
        schema["required"] = required
    return schema


def _value(rng: random.Random, depth: int) -> dict:
    kinds = ["string", "integer", "boolean", "enum", "const", "null", "array"] + (["object"] * 2 if depth < 3 else [])
    kind = rng.choice(kinds)
    if kind == "string":
        schema = {"type": "string", "maxLength": rng.randint(1, 6)}
        if rng.random() < 0.3:
            schema["minLength"] = 1
        return schema
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 200)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 1, 2, "a b", "東京", None, True], rng.randint(1, 4))}
    if kind == "const":
        return {"const": rng.choice(["x", 7, False])}
    if kind == "null":
        return {"type": "null"}
    if kind == "array":
        items = _value(rng, depth + 1) if depth < 3 else {"type": "boolean"}
        schema = {"type": "array", "items": items, "maxItems": rng.randint(1, 3)}
        if rng.random() < 0.3:
            schema["minItems"] = 1
        return schema
    return _object(rng, depth)
