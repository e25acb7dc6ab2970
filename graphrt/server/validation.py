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


# Other servers' names for what completions and chat take under another (vLLM replaced its
# guided_* with structured_outputs), and what to say to a request that sends one.
RENAMED = {
    "guided_json": 'send structured_outputs: {"json": SCHEMA} (or response_format json_schema) instead',
    "guided_regex": 'send structured_outputs: {"regex": PATTERN} instead',
    "guided_choice": 'send structured_outputs: {"choice": [...]} instead',
    "guided_grammar": 'send structured_outputs: {"grammar": EBNF} instead',
    "guided_json_object": 'send response_format: {"type": "json_object"} instead',
    "guided_decoding_backend": "remove it: graphrt's structured outputs always run on xgrammar",
    "max_new_tokens": "send max_tokens instead",  # transformers', TGI's and SGLang's sampling_params' name
    "min_new_tokens": "send min_tokens instead",  # SGLang's
    "no_stop_trim": "send include_stop_str_in_output instead",  # SGLang's
    "sampling_params": "send its fields at the top of the request, or SGLang's request to /generate",
    "stop_sequences": "send stop instead",
}

# pydantic puts the union member it tried into the error location; those are not parameter names
_TYPE_TAG = re.compile(r"^(str|int|float|bool|list|dict|none)$|[\[\-]")


def _model_names() -> set[str]:
    """The request models' class names: a union of models puts the member's in the location."""
    names, models = set(), [StrictModel]
    while models:
        model = models.pop()
        names.add(model.__name__)
        models += model.__subclasses__()
    return names


def validation_error(exc: ValidationError, renamed: dict[str, str] | None = None) -> APIError:
    """The first validation problem as a 400 that names the parameter, e.g. `messages[0].role`.
    `renamed`: advice for unknown parameters the route knows under another name (RENAMED).

    Of a union's errors, the deepest says most (an image part: its `type`, not "not a string").
    """
    errors = exc.errors()
    error = max((e for e in errors if e["loc"][:1] == errors[0]["loc"][:1]), key=lambda e: len(e["loc"]))
    param, models = "", _model_names()
    for part in error["loc"]:
        if isinstance(part, int):
            param += f"[{part}]"
        elif not _TYPE_TAG.search(part) and part not in models:
            param += f".{part}" if param else part
    if error["type"] == "extra_forbidden":
        advice = f"; {renamed[param]}" if renamed and param in renamed else ""
        return APIError(400, f"unrecognized request argument: {param}{advice}", param=param)
    if error["type"] == "missing":
        return APIError(400, f"{param} is required", param=param)
    message = error["msg"].removeprefix("Value error, ")
    return APIError(400, f"{param}: {message}" if param else message, param=param or None)
