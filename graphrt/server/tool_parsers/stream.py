"""A streamed output's calls: what is new in each scan goes out as deltas, and nothing that went
out is taken back."""

from __future__ import annotations

from dataclasses import dataclass

from graphrt.server.tool_parsers.call_text import CallText
from graphrt.server.tool_parsers.parse import new_call_id
from graphrt.server.tool_parsers.readers import ToolCallReader, ToolCallScan


@dataclass
class SentCall:
    """A call the stream has opened, and how much of its arguments went out."""

    call_id: str
    name: str
    arguments_start: int | None  # where its arguments begin in the output (None: it closed without any)
    num_arguments_sent: int = 0

    def goes_on_as(self, call: CallText) -> bool:
        """`call`, read from the output as it is now, is this one going on (not another name, nor
        arguments that begin elsewhere: a key written twice)."""
        return call.name == self.name and call.arguments_start == self.arguments_start


class ToolCallStream:
    """One choice's stream: each `feed` of the text so far gives the deltas to send, in OpenAI's
    shape: `{"content": ...}`, a call's opening `{"tool_calls": [{"index", "id", "type", "function":
    {"name", "arguments": ""}}]}`, then its arguments in fragments `{"tool_calls": [{"index",
    "function": {"arguments": ...}}]}`.

    Once a call has gone out, it stays a call: if the text then breaks it (its object does not go
    on as JSON, a key comes again), the rest of the output goes out as that call's arguments, never
    as content, and the client's finish_reason is "tool_calls" all the same."""

    def __init__(self, reader: ToolCallReader, max_calls: int | None = None, sends_content: bool = True):
        """`sends_content` False: the server's grammar writes the output (tool_choice "required" or
        named), so none of it is content, not even what max_tokens left short of a call."""
        self.reader = reader
        self.max_calls = max_calls
        self.sends_content = sends_content
        self.num_content_sent = 0
        self.calls: list[SentCall] = []
        self.broken = False  # a call that went out was broken by the text after it

    @property
    def made_calls(self) -> bool:
        return bool(self.calls)

    def feed(self, text: str, final: bool = False) -> list[dict]:
        if not self.broken:
            scan = self.reader.scan(text, final)
            if all(index < len(scan.calls) and sent.goes_on_as(scan.calls[index]) for index, sent in enumerate(self.calls)):
                return self._new_deltas(scan)
            self.broken = True
        return self._rest_as_arguments(text)

    def _new_deltas(self, scan: ToolCallScan) -> list[dict]:
        deltas: list[dict] = []
        if self.sends_content and len(scan.content) > self.num_content_sent:
            deltas.append({"content": scan.content[self.num_content_sent :]})
            self.num_content_sent = len(scan.content)
        for index, call in enumerate(scan.calls[: self.max_calls]):
            if index == len(self.calls):
                sent = SentCall(new_call_id(), call.name, call.arguments_start)
                self.calls.append(sent)
                function = {"name": sent.name, "arguments": ""}
                deltas.append({"tool_calls": [{"index": index, "id": sent.call_id, "type": "function", "function": function}]})
            deltas += self._arguments(index, call.arguments_text)
        return deltas

    def _rest_as_arguments(self, text: str) -> list[dict]:
        """The output past what went out of the broken call, as more of its arguments. It is the
        last call sent: a call after another begins only once that one has closed, and a closed call
        cannot break; an open call went out with its arguments begun, so they have a start."""
        index = len(self.calls) - 1
        return self._arguments(index, text[self.calls[index].arguments_start :])

    def _arguments(self, index: int, arguments: str) -> list[dict]:
        """A fragment of call `index`'s arguments: what of `arguments` (all of them so far) is new."""
        call = self.calls[index]
        if len(arguments) <= call.num_arguments_sent:
            return []
        fragment = arguments[call.num_arguments_sent :]
        call.num_arguments_sent = len(arguments)
        return [{"tool_calls": [{"index": index, "function": {"arguments": fragment}}]}]
