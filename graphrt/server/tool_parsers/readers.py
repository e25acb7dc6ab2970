"""The formats: where calls begin in an output and what separates them, for each parser
(`ToolCallReader` and one subclass a format), and the scan of an output so far that they share.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from graphrt.server.tool_parsers.call_text import CallText, NotACall, read_call, skip_whitespace

if TYPE_CHECKING:
    from graphrt.frontend.tokenizer import Tokenizer

TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")


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
        return ToolCallScan("", [CallText(self.name, text, complete=final, arguments_start=0)], well_formed=final)


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
