"""One call's JSON object, read from text that may end anywhere inside it: `{"name": ...,
"arguments": {...}}`, keys in any order, with its arguments kept as the model wrote them."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

_WHITESPACE = re.compile(r"\s*")
_LITERAL = re.compile(r"[^\s,:\[\]{}\"]*")  # a number, true, false or null


class NotACall(Exception):
    """The text where a call should be is not one (not JSON, or not the format's shape)."""


def skip_whitespace(text: str, pos: int) -> int:
    return _WHITESPACE.match(text, pos).end()


def value_end(text: str, pos: int) -> int | None:
    """Where the JSON value that starts at `pos` ends, or None if the text ends first. Brackets and
    strings are followed, not checked: `json.loads` checks what is kept."""
    first = text[pos]
    if first == '"':
        index = pos + 1
        while index < len(text):
            if text[index] == "\\":
                index += 2
            elif text[index] == '"':
                return index + 1
            else:
                index += 1
        return None
    if first in "{[":
        depth, in_string, index = 0, False, pos
        while index < len(text):
            char = text[index]
            if in_string:
                if char == "\\":
                    index += 1
                elif char == '"':
                    in_string = False
            elif char == '"':
                in_string = True
            elif char in "{[":
                depth += 1
            elif char in "}]":
                depth -= 1
                if depth == 0:
                    return index + 1
            index += 1
        return None
    if first in "-0123456789tfn":
        end = _LITERAL.match(text, pos).end()
        return end if end < len(text) else None  # a number may go on
    raise NotACall


@dataclass
class CallText:
    """One call as read so far."""

    name: str | None = None
    arguments: str | None = None  # the arguments object as the model wrote it, so far (None: not begun)
    complete: bool = False  # the call's object is closed
    arguments_start: int | None = None  # where `arguments` begins in the text read

    @property
    def begun(self) -> bool:
        """Name and arguments have begun: from here on a stream sends the call."""
        return self.name is not None and (self.arguments is not None or self.complete)

    @property
    def arguments_text(self) -> str:
        return self.arguments if self.arguments is not None else ("{}" if self.complete else "")


def json_string(quoted: str) -> str:
    """A JSON string literal's value; NotACall where the model wrote one JSON cannot read (a raw
    newline, an unknown escape)."""
    try:
        return json.loads(quoted)
    except ValueError:
        raise NotACall from None


def read_call(text: str, pos: int, argument_keys: tuple[str, ...]) -> tuple[CallText, int | None]:
    """A `{"name": ..., "arguments": {...}}` object at `pos`, keys in any order (others are skipped);
    returns the call and where its object ends (None: the text ends first)."""
    call = CallText()
    if pos >= len(text):
        return call, None
    if text[pos] != "{":
        raise NotACall
    index = pos + 1
    while True:
        index = skip_whitespace(text, index)
        if index >= len(text):
            return call, None
        if text[index] == "}":
            call.complete = True
            return call, index + 1
        if text[index] != '"':
            raise NotACall
        key_end = value_end(text, index)
        if key_end is None:
            return call, None
        key = json_string(text[index:key_end])
        index = skip_whitespace(text, key_end)
        if index >= len(text):
            return call, None
        if text[index] != ":":
            raise NotACall
        index = skip_whitespace(text, index + 1)
        if index >= len(text):
            return call, None
        end = value_end(text, index)
        if key == "name":
            if text[index] != '"':
                raise NotACall
            if end is None:
                return call, None
            call.name = json_string(text[index:end])
        elif key in argument_keys:
            if text[index] != "{":
                raise NotACall
            call.arguments = text[index:end]  # to the end of the text while it is open
            call.arguments_start = index
        if end is None:
            return call, None
        index = skip_whitespace(text, end)
        if index >= len(text):
            return call, None
        if text[index] == "}":
            call.complete = True
            return call, index + 1
        if text[index] != ",":
            raise NotACall
        index += 1
