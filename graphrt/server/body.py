"""A request body as the JSON object it must be: UTF-8, JSON, an object, valid Unicode. Every
problem is an APIError (400) saying what is wrong, before any route reads a field."""

from __future__ import annotations

import json
import sys
from typing import Any

from graphrt.sampling_params import INT64_MAX
from graphrt.server.errors import APIError


def decode_body(body: bytes) -> dict:
    """A request body as the JSON object it must be; raise APIError(400) saying what is wrong with it."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(400, f"the request body is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
    raw = decode_json(text)
    if not isinstance(raw, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(raw).__name__}")
    check_unicode(raw)
    return raw


def decode_json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise APIError(400, f"the request body is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    except RecursionError:
        raise APIError(400, "the request body nests arrays or objects too deeply to parse; no parameter needs more than a few levels") from None
    except ValueError:  # Python's limit on int-string conversion (CVE-2020-10735)
        raise APIError(
            400, f"the request body holds an integer with more than {sys.get_int_max_str_digits()} digits; "
            f"no parameter takes one beyond {INT64_MAX}"
        ) from None


def check_unicode(raw: dict) -> None:
    """Refuse a lone UTF-16 surrogate (JSON allows the escape "\\ud800"): no tokenizer can encode it,
    nor can an error message that quotes it. Walks without recursion, as the body may nest deeply."""
    pending: list[tuple[str, Any]] = [("", raw)]
    while pending:
        path, value = pending.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                if not _is_unicode(key):
                    raise APIError(400, f"a key {'in ' + path if path else 'of the request'} holds a lone UTF-16 surrogate ({ascii(key)}); "
                                   "send valid Unicode, with surrogates only in pairs", param=path or None)
                pending.append((f"{path}.{key}" if path else key, item))
        elif isinstance(value, list):
            pending.extend((f"{path}[{index}]", item) for index, item in enumerate(value))
        elif isinstance(value, str) and not _is_unicode(value):
            position = next(i for i, char in enumerate(value) if "\ud800" <= char <= "\udfff")
            raise APIError(400, f"{path}: holds a lone UTF-16 surrogate ({ascii(value[position])} at character {position}); "
                           "send valid Unicode, with surrogates only in pairs", param=path)


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
