"""Strict request models, and their validation errors as 400s that name the parameter.

Validation is strict, as OpenAI's own API is: no string-for-number coercion, no NaN, unknown fields
refused by name.
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, ValidationError

from graphrt.server.errors import APIError


class StrictModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


# Older or other servers' names for what graphrt takes under another (vLLM's guided_* were
# replaced by structured_outputs); a refusal of one says what to send instead.
RENAMED = {
    "guided_json": "structured_outputs: {\"json\": SCHEMA} or response_format json_schema",
    "guided_regex": "structured_outputs: {\"regex\": PATTERN}",
    "guided_choice": "structured_outputs: {\"choice\": [...]}",
    "guided_grammar": "structured_outputs: {\"grammar\": EBNF}",
    "guided_json_object": "response_format: {\"type\": \"json_object\"}",
    "guided_decoding_backend": "nothing: graphrt's structured outputs always run on xgrammar",
    "max_new_tokens": "max_tokens",
    "stop_sequences": "stop",
}

# pydantic puts the union member it tried into the error location; those are not parameter names
_TYPE_TAG = re.compile(r"^(str|int|float|bool|list|dict|none)$|[\[\-]")


def validation_error(exc: ValidationError) -> APIError:
    """The first validation problem as a 400 that names the parameter, e.g. `messages[0].role`.

    Of a union's errors, the deepest says most (an image part: its `type`, not "not a string").
    """
    errors = exc.errors()
    error = max((e for e in errors if e["loc"][:1] == errors[0]["loc"][:1]), key=lambda e: len(e["loc"]))
    param = ""
    for part in error["loc"]:
        if isinstance(part, int):
            param += f"[{part}]"
        elif not _TYPE_TAG.search(part):
            param += f".{part}" if param else part
    if error["type"] == "extra_forbidden":
        instead = f"; send {RENAMED[param]} instead" if param in RENAMED else ""
        return APIError(400, f"unrecognized request argument: {param}{instead}", param=param)
    if error["type"] == "missing":
        return APIError(400, f"{param} is required", param=param)
    message = error["msg"].removeprefix("Value error, ")
    return APIError(400, f"{param}: {message}" if param else message, param=param or None)
