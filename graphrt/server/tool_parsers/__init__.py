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

A reader (readers) scans the whole text so far and says what it holds (`ToolCallScan`): the content
before the first call and each call begun so far, each call's object read by call_text. Text only
grows, and so does what a scan finds, so a stream sends what is new since the last scan
(`ToolCallStream`, stream). A finished output is read as vLLM reads it (`parse_tool_calls`, parse):
if any call is not complete JSON naming a given tool, the whole output is content, except where
the server's own grammar wrote it ("required" or named, cut short by max_tokens or a stop string): then the calls
begun go out as far as they got (`begun_tool_calls`), as a stream of it sent them. A stream cannot
take back what it sent: there a call counts once its name and the start of its arguments are read,
and if the text breaks it after that, the rest of the output is that call's arguments.
"""

from graphrt.server.tool_parsers.parse import ParsedToolCall, begun_tool_calls, new_call_id, parse_tool_calls
from graphrt.server.tool_parsers.readers import (
    READERS,
    TOOL_CALL_PARSERS,
    HermesReader,
    Llama3JsonReader,
    MistralReader,
    NamedReader,
    RequiredReader,
    ToolCallReader,
    ToolCallScan,
    detect_tool_call_parser,
    markers_are_special_tokens,
)
from graphrt.server.tool_parsers.stream import ToolCallStream

__all__ = [
    "READERS",
    "TOOL_CALL_PARSERS",
    "HermesReader",
    "Llama3JsonReader",
    "MistralReader",
    "NamedReader",
    "ParsedToolCall",
    "RequiredReader",
    "ToolCallReader",
    "ToolCallScan",
    "ToolCallStream",
    "begun_tool_calls",
    "detect_tool_call_parser",
    "markers_are_special_tokens",
    "new_call_id",
    "parse_tool_calls",
]
