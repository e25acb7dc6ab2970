"""A finished output's calls, read as vLLM reads them: all well formed, or none."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from graphrt.server.tool_parsers.readers import ToolCallReader


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


def begun_tool_calls(reader: ToolCallReader, text: str, max_calls: int | None = None) -> list[ParsedToolCall]:
    """The calls a grammar-constrained output (tool_choice "required" or named) had begun when it
    was cut short (max_tokens, a stop string), their arguments as far as they got: what a stream of
    it sent."""
    return [ParsedToolCall(call.name, call.arguments_text) for call in reader.scan(text, final=True).calls[:max_calls]]
