"""Tool calls in a model's output: where they begin, which function each calls, and its arguments as
the model wrote them.

Three formats, read as vLLM's parsers of the same names read them (`graphrt serve --tool-call-parser`):

- hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one or more.
- llama3_json: `<|python_tag|>` (or, without it, an output that begins with `{`), then one or more
  `{"name": ..., "parameters": {...}}` ("arguments" too) separated by `;`.
- mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or, without the marker, an output
  that begins with `[`.

A marker may be a special token of the model's tokenizer (`[TOOL_CALLS]` and `<|python_tag|>` are in
Mistral's and Llama 3's), which decoding drops by default; where one is, the server decodes a
tools "auto" request with `skip_special_tokens=False` (`markers_are_special_tokens`), as vLLM's
parsers ask, so the parser sees it.

and two the server's own grammars make (graphrt.server.tool_choice): for tool_choice "required", a
JSON array of `{"name": ..., "parameters": {...}}` (mistral's list, unmarked), and for a named tool,
the whole output is that call's arguments.

A reader scans the whole text so far and says what it holds (`ToolCallScan`): the content before the
first call and each call begun so far. Text only grows, and so does what a scan finds, so a stream
sends what is new since the last scan (`ToolCallStream`). A finished output is read as vLLM reads
it (`parse_tool_calls`): if any call is not complete JSON naming a given tool, the whole output is
content. A stream cannot take back what it sent: there a call counts once its name and the start of
its arguments are read.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from graphrt.frontend.tokenizer import Tokenizer

TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")

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


@dataclass
class ToolCallScan:
    """What a text holds so far: content, the calls begun, and whether they are well formed (every
    call complete, nothing broken between them)."""

    content: str
    calls: list[CallText] = field(default_factory=list)
    well_formed: bool = True


class ToolCallReader:
    """The format of one parser, for one request's tools (a call must name one of them)."""

    markers: tuple[str, ...] = ()  # where calls begin, anywhere in the output
    end_marker: str | None = None  # where each call ends (hermes')
    bare_start: str | None = None  # calls may also begin the output (after whitespace) with this, unmarked
    argument_keys: tuple[str, ...] = ("arguments",)

    def __init__(self, tool_names: list[str] | tuple[str, ...] | frozenset[str]):
        self.tool_names = frozenset(tool_names)

    @classmethod
    def marker_texts(cls) -> tuple[str, ...]:
        """Every marker the format reads."""
        return cls.markers + ((cls.end_marker,) if cls.end_marker is not None else ())

    def read_calls(self, text: str, pos: int) -> tuple[list[CallText], bool]:
        """The calls from `pos` (just after the marker, or at the bare start) and whether something
        broke the format after them. Raises NotACall if the first is none."""
        first = self.first_call(text, pos)
        if first is None:
            return [], False
        calls: list[CallText] = []
        pos = first
        while True:
            try:
                call, end = read_call(text, skip_whitespace(text, pos), self.argument_keys)
            except NotACall:
                if not calls:
                    raise
                return calls, True
            calls.append(call)
            if end is None:
                return calls, False
            following = self.after_call(text, skip_whitespace(text, end))
            if isinstance(following, bool):
                return calls, following
            pos = following

    def first_call(self, text: str, pos: int) -> int | None:
        """Where the first call begins (None: not written yet). Raises NotACall if none can."""
        return pos

    def after_call(self, text: str, after: int) -> int | bool:
        """After a call (at `after`): where the next call begins, or, where the calls end, whether
        something broke the format (True) or not (False)."""
        raise NotImplementedError

    def find_start(self, text: str) -> tuple[int, int] | None:
        """(where the content ends, where the calls begin), or None while no call has begun."""
        found = [(text.find(marker), marker) for marker in self.markers]
        found = [(index, marker) for index, marker in found if index != -1]
        first = skip_whitespace(text, 0)
        # "[TOOL_CALLS]" begins with mistral's bare "[": the marker, or what may yet be it, comes first
        marked_first = (found and min(found)[0] == first) or any(marker.startswith(text[first:]) for marker in self.markers)
        if self.bare_start is not None and text.startswith(self.bare_start, first) and not marked_first:
            return first, first
        if not found:
            return None
        index, marker = min(found)
        return index, index + len(marker)

    def held_back(self, text: str) -> int:
        """Characters at the end of `text` that may begin a call: a marker's first characters, or
        (with a bare start) all of an output that is only whitespace so far."""
        if self.bare_start is not None and not text.strip():
            return len(text)
        return max((size for marker in self.markers for size in range(len(marker) - 1, 0, -1) if text.endswith(marker[:size])), default=0)

    def scan(self, text: str, final: bool = False) -> ToolCallScan:
        start = self.find_start(text)
        if start is None:
            if final:
                return ToolCallScan(text)
            content = text[: len(text) - self.held_back(text)]
            return ToolCallScan(content.rstrip())  # whitespace before a call is not content
        content_end, calls_start = start
        try:
            calls, broken = self.read_calls(text, calls_start)
        except NotACall:
            return ToolCallScan(text)
        if not calls or not calls[0].begun:
            # Not known yet whether this is a call; at the end, it never was one.
            return ToolCallScan(text) if final else ToolCallScan(text[:content_end].rstrip())
        if calls[0].name not in self.tool_names:
            return ToolCallScan(text)
        begun: list[CallText] = []
        for call in calls:
            if not call.begun or call.name not in self.tool_names:
                broken = broken or call.complete or call.name is not None or final
                break
            begun.append(call)
        well_formed = not broken and all(call.complete for call in begun)
        return ToolCallScan(text[:content_end].rstrip(), begun, well_formed)


class HermesReader(ToolCallReader):
    markers = ("<tool_call>",)
    end_marker = "</tool_call>"

    def after_call(self, text: str, after: int) -> int | bool:
        if text.startswith(self.end_marker, after):
            after += len(self.end_marker)
        elif not self.end_marker.startswith(text[after:]):
            return True  # text after the call where its end marker should be
        pos = text.find(self.markers[0], after)
        if pos == -1:
            return False  # what follows the last call is dropped, as vLLM does
        return pos + len(self.markers[0])


class Llama3JsonReader(ToolCallReader):
    markers = ("<|python_tag|>",)
    bare_start = "{"
    argument_keys = ("parameters", "arguments")

    def after_call(self, text: str, after: int) -> int | bool:
        if after < len(text) and text[after] == ";":
            return after + 1
        return after < len(text)


class MistralReader(ToolCallReader):
    markers = ("[TOOL_CALLS]",)
    bare_start = "["

    def first_call(self, text: str, pos: int) -> int | None:
        """Past the "[" of the JSON array the calls are in."""
        pos = skip_whitespace(text, pos)
        if pos >= len(text):
            return None
        if text[pos] != "[":
            raise NotACall
        return pos + 1

    def after_call(self, text: str, after: int) -> int | bool:
        if after >= len(text) or text[after] == "]":
            return False
        return after + 1 if text[after] == "," else True


class RequiredReader(MistralReader):
    """tool_choice "required": the grammar makes the output a JSON array of calls."""

    markers = ()
    argument_keys = ("parameters",)


class NamedReader(ToolCallReader):
    """A named tool_choice: the grammar makes the whole output that call's arguments."""

    def __init__(self, name: str):
        super().__init__([name])
        self.name = name

    def scan(self, text: str, final: bool = False) -> ToolCallScan:
        return ToolCallScan("", [CallText(self.name, text, complete=final)], well_formed=final)


READERS: dict[str, type[ToolCallReader]] = {"hermes": HermesReader, "llama3_json": Llama3JsonReader, "mistral": MistralReader}


def markers_are_special_tokens(parser: str, tokenizer: Tokenizer | None) -> bool:
    """Some marker of `parser` (a name in READERS) is a special token of the model's tokenizer:
    its text must keep special tokens for the parser to see the marker."""
    return tokenizer is not None and any(tokenizer.is_special_token(marker) for marker in READERS[parser].marker_texts())


def detect_tool_call_parser(chat_template: str | None) -> str:
    """The format a chat template teaches its model, by the markers it writes; hermes if none."""
    template = chat_template or ""
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return "hermes"


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str  # a JSON object, as the model wrote it

    def body(self, call_id: str) -> dict:
        return {"id": call_id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_tool_calls(reader: ToolCallReader, text: str, max_calls: int | None = None) -> tuple[str | None, list[ParsedToolCall]]:
    """A finished output's content and calls (at most `max_calls`). Unless every call is complete
    JSON with an object of arguments, naming a given tool, there are none and the text is content."""
    scan = reader.scan(text, final=True)
    if not scan.calls:
        return text, []
    if not scan.well_formed or not all(_is_json_object(call.arguments_text) for call in scan.calls):
        return text, []
    calls = [ParsedToolCall(call.name, call.arguments_text) for call in scan.calls[:max_calls]]
    return scan.content or None, calls


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except (ValueError, RecursionError):
        return False


class ToolCallStream:
    """One choice's stream: each `feed` of the text so far gives the deltas to send, in OpenAI's
    shape: `{"content": ...}`, a call's opening `{"tool_calls": [{"index", "id", "type", "function":
    {"name", "arguments": ""}}]}`, then its arguments in fragments `{"tool_calls": [{"index",
    "function": {"arguments": ...}}]}`."""

    def __init__(self, reader: ToolCallReader, max_calls: int | None = None):
        self.reader = reader
        self.max_calls = max_calls
        self.num_content_sent = 0
        self.call_ids: list[str] = []
        self.num_arguments_sent: list[int] = []

    @property
    def made_calls(self) -> bool:
        return bool(self.call_ids)

    def feed(self, text: str, final: bool = False) -> list[dict]:
        scan = self.reader.scan(text, final)
        deltas: list[dict] = []
        if len(scan.content) > self.num_content_sent:
            deltas.append({"content": scan.content[self.num_content_sent :]})
            self.num_content_sent = len(scan.content)
        for index, call in enumerate(scan.calls[: self.max_calls]):
            if index == len(self.call_ids):
                self.call_ids.append(new_call_id())
                self.num_arguments_sent.append(0)
                opening = {"index": index, "id": self.call_ids[index], "type": "function", "function": {"name": call.name, "arguments": ""}}
                deltas.append({"tool_calls": [opening]})
            arguments = call.arguments_text
            if len(arguments) > self.num_arguments_sent[index]:
                fragment = arguments[self.num_arguments_sent[index] :]
                deltas.append({"tool_calls": [{"index": index, "function": {"arguments": fragment}}]})
                self.num_arguments_sent[index] = len(arguments)
        return deltas
