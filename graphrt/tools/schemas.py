"""Seeded random JSON schemas of the shapes requests constrain output with: objects with required and
optional fields, nested objects, arrays, enums, string patterns and lengths, number ranges. Every
schema bounds its strings and arrays, so the shortest valid output is short and a model that follows
it ends. For the structured-output tests and benchmarks/structured_bench.py."""

from __future__ import annotations

import random

FIELD_NAMES = ("name", "city", "age", "score", "tags", "kind", "id", "owner", "items", "count", "label", "active", "price", "code")
WORDS = ("red", "green", "blue", "small", "large", "north", "south", "alpha", "beta", "open", "closed")
PATTERNS = (r"^[A-Z][a-z]{1,8}$", r"^[0-9]{3}-[0-9]{4}$", r"^[a-z]+(-[a-z]+)?$", r"^(yes|no|maybe)$")


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """An object schema of 1-4 fields, a field nested one or two levels down now and then."""
    names = rng.sample(FIELD_NAMES, rng.randint(1, 4))
    properties = {name: _value_schema(rng, depth) for name in names}
    required = [name for name in names if rng.random() < 0.75] or names[:1]
    return {"type": "object", "properties": properties, "required": required}


def _value_schema(rng: random.Random, depth: int) -> dict:
    kinds = ["string", "pattern", "integer", "number", "boolean", "enum", "array"] + (["object"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "minLength": 1, "maxLength": rng.randint(3, 16)}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(PATTERNS)}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(1, 500)}
    if kind == "number":
        return {"type": "number", "minimum": 0, "maximum": rng.choice((1, 100, 1000))}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(WORDS, rng.randint(2, 4))}
    if kind == "array":
        items = rng.choice([{"type": "integer", "minimum": 0, "maximum": 99}, {"enum": rng.sample(WORDS, 3)},
                            {"type": "string", "maxLength": 8}])
        return {"type": "array", "items": items, "minItems": rng.randint(0, 1), "maxItems": rng.randint(1, 3)}
    return random_schema(rng, depth + 1)


def schema_prompt(schema: dict, index: int) -> str:
    """A chat prompt asking for one JSON value of `schema`."""
    fields = ", ".join(schema["properties"])
    return f"Write a JSON object for record number {index} with the fields {fields}. Reply with the JSON only."
