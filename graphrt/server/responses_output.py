"""The Responses API's answer: the response object, and the semantic events that stream it.

A response is written from what the chat route would answer: the chat format's final message
(its text and tool calls) becomes output items, a message and function_call items; in a stream,
each chat delta becomes OpenAI's events (`response.output_text.delta`,
`response.function_call_arguments.delta`, ...) between the items' `added` and `done`, each
numbered by `sequence_number`, and the stream ends with the whole response in
`response.completed` (or `response.incomplete`, when max_output_tokens cut it short).

Logprobs, where the request includes them, are the chat route's, token by token, in the same
shape: a message's output_text carries its tokens' (each text delta those of its tokens), and is
`[]` where none were asked for, as OpenAI sends it. Tokens that spell a tool call, and the stop
token that ends the output, which spells no text, carry none.
"""

from __future__ import annotations

import json
import uuid
from typing import AsyncIterator

from graphrt.frontend.async_engine import Disconnected, Failed, GenerationJob
from graphrt.sampling_params import SamplingParams
from graphrt.server.generation import Generation
from graphrt.server.responses import ChatFormat, ChoiceState, ResponseFormat
from graphrt.server.responses_api import NamedFunction, ResponsesRequest


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def status_of(choice: ChoiceState) -> str:
    return "incomplete" if choice.finish_reason == "length" else "completed"


def message_item(item_id: str, text: str, status: str, logprobs: list[dict]) -> dict:
    return {
        "type": "message", "id": item_id, "status": status, "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}],
    }


def text_logprobs(chat_logprobs: dict | None, choice: ChoiceState) -> list[dict]:
    """The logprobs of a chat choice's (or its last chunk's) tokens, less the stop token's where the
    output ended on one: finish reason "stop" means a stop token here (a Responses request sets no
    stop strings), and that token is no part of the text (OutputProcessor._extend)."""
    tokens = chat_logprobs["content"] if chat_logprobs is not None else []
    return tokens[:-1] if tokens and choice.finish_reason == "stop" else tokens


def num_spelling(tokens: list[dict], start: int, end: int) -> int:
    """How many of `tokens` (chat logprobs, the first one's text at character `start`), from the
    first, end by character `end`: where tool calls follow a message's text (the content before
    them), the tokens that are the message's."""
    count = 0
    for token in tokens:
        start += len(token["token"])
        if start > end:
            break
        count += 1
    return count


def function_call_item(call: dict, status: str) -> dict:
    """`call` is a chat completion's tool call; its id becomes the call_id a function_call_output answers."""
    function = call["function"]
    return {
        "type": "function_call", "id": new_id("fc"), "call_id": call["id"], "name": function["name"],
        "arguments": function.get("arguments") or "", "status": status,
    }


def usage_body(prompt_tokens: int, choice: ChoiceState) -> dict:
    return {
        "input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": choice.num_tokens, "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + choice.num_tokens,
    }


class ResponsesFormat(ResponseFormat):
    """A Responses answer written from the chat format's (`chat`), which reads the model's output:
    its text, and its tool calls where the request offers tools."""

    def __init__(self, model_id: str, request: ResponsesRequest, chat: ChatFormat):
        super().__init__(model_id)
        self.id = new_id("resp")
        self.request = request
        self.chat = chat
        self.sampled_with: SamplingParams | None = None  # once admitted: what the request samples with

    def start(self, job: GenerationJob, choices: list[ChoiceState]) -> None:
        self.chat.start(job, choices)
        self.sampled_with = job.params[0]

    def response(self, prompt_tokens: int, choices: list[ChoiceState]) -> dict:
        [choice] = choices
        [chat_choice] = self.chat.response(prompt_tokens, choices)["choices"]
        message, status = chat_choice["message"], status_of(choice)
        calls = message.get("tool_calls") or []
        text = message.get("content") or ""
        logprobs = text_logprobs(chat_choice["logprobs"], choice)
        if calls:
            logprobs = logprobs[: num_spelling(logprobs, 0, len(text))]
        output = [message_item(new_id("msg"), text, status, logprobs)] if text or not calls else []
        output += [function_call_item(call, "completed") for call in calls]
        return self.body(status, output, usage_body(prompt_tokens, choice))

    def body(self, status: str, output: list[dict], usage: dict | None, error: dict | None = None) -> dict:
        """The response object; what the request set (or its default) is repeated, as OpenAI does."""
        request = self.request
        text_format = request.text.format if request.text is not None else None
        tool_choice = request.tool_choice or "auto"
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "background": False, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": request.instructions, "max_output_tokens": request.max_output_tokens, "max_tool_calls": None,
            "metadata": request.metadata or {}, "model": self.model_id, "output": output,
            "parallel_tool_calls": True if request.parallel_tool_calls is None else request.parallel_tool_calls,
            "previous_response_id": None, "reasoning": {"effort": None, "summary": None},
            "service_tier": "default", "store": False,  # nothing is kept: the id cannot be retrieved or continued from
            "temperature": self._sampling("temperature"),
            "text": {"format": text_format.body() if text_format is not None else {"type": "text"}},
            "tool_choice": {"type": "function", "name": tool_choice.name} if isinstance(tool_choice, NamedFunction) else tool_choice,
            "tools": [tool.body() for tool in request.tools or []],
            "top_logprobs": request.top_logprobs or 0, "top_p": self._sampling("top_p"),
            "truncation": request.truncation or "disabled", "usage": usage, "user": request.user,
        }


    def _sampling(self, name: str) -> float:
        """The request's value, or what it sampled with where it gave none (the API's default or
        the model's generation_config.json); the API's default before it was admitted."""
        given = getattr(self.request, name)
        if given is not None:
            return given
        return getattr(self.sampled_with, name) if self.sampled_with is not None else 1.0


class ResponsesEvents:
    """The events of one streamed response, in OpenAI's order and numbered, built from chat deltas.

    Output items open when their first delta comes (text opens a message, a tool call a
    function_call item) and close when another item opens or the response ends; `output` holds
    them as the final response reports them.

    A chat delta's logprobs are its tokens', whose text may come in a later delta (text that is not
    final yet, or may begin a tool call): they wait for the text they spell. Without tools, every
    token is the message's; with tools, a text delta takes the tokens that spell the message's text
    so far, and those still waiting when a call opens are the call's, left out.
    """

    def __init__(self, fmt: ResponsesFormat):
        self.format = fmt
        self.sequence_number = 0
        self.output: list[dict] = []
        self.message: dict | None = None  # the open message item
        self.call: dict | None = None  # the open function_call item
        self.call_index: int | None = None  # its index among the chat delta's tool calls
        self.waiting: list[dict] = []  # logprobs received and not yet sent with a text delta
        self.num_spelled = 0  # characters of the open message's text that its sent logprobs' tokens spell

    def _event(self, event_type: str, **fields) -> str:
        payload = {"type": event_type, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {event_type}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def _item_event(self, event_type: str, item: dict) -> str:
        return self._event(event_type, output_index=self.output.index(item), item=item)

    def opening(self) -> list[str]:
        body = self.format.body("in_progress", [], None)
        return [self._event("response.created", response=body), self._event("response.in_progress", response=body)]

    def delta(self, delta: dict, logprobs: list[dict] | None = None) -> list[str]:
        """The events of one chat delta (with the logprobs of the tokens its chunk brought): its
        text, then its tool calls' fragments."""
        self.waiting += logprobs or []
        events = self._text(delta["content"]) if delta.get("content") else []
        for call in delta.get("tool_calls") or []:
            events += self._call(call)
        if self.call is not None:
            self.waiting = []  # a call's tokens
        return events

    def _text(self, text: str) -> list[str]:
        events = []
        if self.message is None:
            events += self._close_call()
            events += self._open_message()
        part = self.message["content"][0]
        part["text"] += text
        logprobs = self._take_logprobs(len(part["text"]))
        part["logprobs"] += logprobs
        events.append(self._event(
            "response.output_text.delta", item_id=self.message["id"], output_index=self.output.index(self.message),
            content_index=0, delta=text, logprobs=logprobs,
        ))
        return events

    def _take_logprobs(self, num_chars: int) -> list[dict]:
        """The waiting logprobs that the open message's text, `num_chars` long now, spells."""
        count = len(self.waiting)
        if self.format.chat.tool_calling is not None:
            count = num_spelling(self.waiting, self.num_spelled, num_chars)
        taken, self.waiting = self.waiting[:count], self.waiting[count:]
        self.num_spelled += sum(len(token["token"]) for token in taken)
        return taken

    def _open_message(self) -> list[str]:
        self.message = {"type": "message", "id": new_id("msg"), "status": "in_progress", "role": "assistant", "content": []}
        self.output.append(self.message)
        self.num_spelled = 0
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        events = [self._item_event("response.output_item.added", self.message)]
        events.append(self._event(
            "response.content_part.added", item_id=self.message["id"], output_index=self.output.index(self.message),
            content_index=0, part=part,
        ))
        self.message["content"].append(part)
        return events

    def _close_message(self, status: str) -> list[str]:
        if self.message is None:
            return []
        message, self.message = self.message, None
        part, where = message["content"][0], {"item_id": message["id"], "output_index": self.output.index(message), "content_index": 0}
        message["status"] = status
        return [
            self._event("response.output_text.done", **where, text=part["text"], logprobs=part["logprobs"]),
            self._event("response.content_part.done", **where, part=part),
            self._item_event("response.output_item.done", message),
        ]

    def _call(self, call: dict) -> list[str]:
        events = []
        function = call.get("function") or {}
        if call.get("index") != self.call_index or self.call is None:
            events += self._close_message("completed")
            events += self._close_call()
            self.call = function_call_item({"id": call.get("id") or new_id("call"), "function": {"name": function.get("name") or ""}}, "in_progress")
            self.call_index = call.get("index")
            self.output.append(self.call)
            events.append(self._item_event("response.output_item.added", self.call))
        arguments = function.get("arguments") or ""
        if arguments:
            self.call["arguments"] += arguments
            events.append(self._event(
                "response.function_call_arguments.delta", item_id=self.call["id"], output_index=self.output.index(self.call), delta=arguments,
            ))
        return events

    def _close_call(self) -> list[str]:
        if self.call is None:
            return []
        call, self.call = self.call, None
        call["status"] = "completed"
        return [
            self._event("response.function_call_arguments.done", item_id=call["id"], output_index=self.output.index(call), arguments=call["arguments"]),
            self._item_event("response.output_item.done", call),
        ]

    def closing(self, prompt_tokens: int, choice: ChoiceState) -> list[str]:
        """The open items' `done` events, then the whole response. A response with no output at all
        still says so with an empty message, as a response that is not streamed does."""
        status = status_of(choice)
        events = [] if self.output else self._open_message()
        events += self._close_message(status) + self._close_call()
        body = self.format.body(status, self.output, usage_body(prompt_tokens, choice))
        return events + [self._event("response.completed" if status == "completed" else "response.incomplete", response=body)]

    def failed(self, message: str) -> str:
        error = {"code": "server_error", "message": message}
        return self._event("response.failed", response=self.format.body("failed", self.output, None, error))


class ResponsesGeneration(Generation):
    """A generation whose stream is Responses events; admission, disconnects, clean-up and metrics
    are the chat route's."""

    format: ResponsesFormat

    async def events(self) -> AsyncIterator[str]:
        stream = ResponsesEvents(self.format)
        [choice] = self.choices
        try:
            for event in stream.opening():
                yield event
            while not self.finished:
                update = await self.job.updates.get()
                if isinstance(update, Disconnected):
                    return
                if isinstance(update, Failed):
                    self.outcome = "error"
                    yield stream.failed(update.message)
                    return
                self.apply(update)
                for piece in self.format.chat.delta_choices(0, choice, choice.take_delta()):
                    for event in stream.delta(piece["delta"], text_logprobs(piece["logprobs"], choice)):
                        yield event
            self._set_finished_outcome()
            for event in stream.closing(self.prompt_tokens, choice):
                yield event
        finally:
            self.close()
