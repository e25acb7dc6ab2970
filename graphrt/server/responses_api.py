"""The Responses API's request (`POST /v1/responses`), translated into a chat completion request.

graphrt serves Responses statelessly, as vLLM does by default: nothing is stored, so the whole
conversation comes in `input` each time and `previous_response_id` is refused. A request becomes
the chat request it means (instructions as a system message first, input items as messages,
function calls as an assistant's tool calls and their outputs as tool messages, `text.format` as
`response_format`, flat tools as chat's nested ones, `include: ["message.output_text.logprobs"]`
as `logprobs: true` with `top_logprobs`) and runs the chat route's path: chat template, grammar,
tool-call parsing, sampling, logprobs, admission, metrics. Errors name the Responses
request's parameters, not the chat request's. graphrt.server.responses_output writes the answer
in the Responses shape.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from typing import Annotated, Any, Iterator, Literal, Union

from pydantic import Discriminator, Field, Tag, ValidationError, field_validator

from graphrt.sampling_params import MAX_LOGPROBS
from graphrt.server.body import decode_body
from graphrt.server.chat_protocol import ChatCompletionRequest, text_only
from graphrt.server.errors import APIError
from graphrt.server.validation import StrictModel, validation_error


class ContentPart(StrictModel):
    """Text in a message: input_text in what a user writes, output_text in an assistant's earlier
    output (sent back as it came, with its annotations and logprobs, which are not read)."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class MessageItem(StrictModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]
    # What an earlier response's output item carries, when a client sends it back as input.
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: Literal["commentary", "final_answer"] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content):
        return text_only(content, "input_text parts")

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class FunctionCallItem(StrictModel):
    """A call the model made earlier in the conversation."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str  # JSON, as the model wrote it
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(StrictModel):
    """The result of the call with `call_id`, which an earlier item of `input` made."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[ContentPart]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    @property
    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(part.text for part in self.output)


def _item_tag(item: Any) -> str | None:
    """A message may leave out its type (OpenAI's "easy input message"); other items name theirs."""
    kind = item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", None)
    return f"{kind}-item" if isinstance(kind, str) else None


# Hyphenated tags: validation_error leaves them out of the parameter it names, as it does pydantic's own.
InputItem = Annotated[
    Union[
        Annotated[MessageItem, Tag("message-item")],
        Annotated[FunctionCallItem, Tag("function_call-item")],
        Annotated[FunctionCallOutputItem, Tag("function_call_output-item")],
    ],
    Discriminator(
        _item_tag,
        custom_error_type="input_item",
        custom_error_message="an input item is a message ({'role', 'content'}), a function_call or a function_call_output",
    ),
]


class TextFormat(StrictModel):
    """`text.format`: plain text (the default), any JSON object, or JSON that a schema describes;
    chat's `response_format`, with the schema's fields at the top."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None  # json_schema only, as the three below
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None  # graphrt always holds the output to the schema

    def _schema_fields(self) -> dict[str, Any]:
        fields = {"name": self.name, "schema": self.schema_, "description": self.description, "strict": self.strict}
        return {name: value for name, value in fields.items() if value is not None}

    def check(self) -> None:
        given = list(self._schema_fields())
        if self.type != "json_schema" and given:
            raise APIError(400, f"text.format.{given[0]} belongs to format type json_schema, not {self.type}", param=f"text.format.{given[0]}")

    def response_format(self) -> dict:
        if self.type != "json_schema":
            return {"type": self.type}
        return {"type": "json_schema", "json_schema": self._schema_fields()}

    def body(self) -> dict:
        """As a response repeats it."""
        if self.type != "json_schema":
            return {"type": self.type}
        return {"type": "json_schema", "name": self.name, "schema": self.schema_, "description": self.description, "strict": self.strict}


class TextConfig(StrictModel):
    format: TextFormat | None = None
    verbosity: str | None = None  # accepted and ignored: for OpenAI's reasoning models; no chat template here takes it


class FunctionTool(StrictModel):
    """A function the model may call, in the Responses API's flat shape (chat nests it under `function`)."""

    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def chat_tool(self) -> dict:
        function = {"name": self.name, "description": self.description, "parameters": self.parameters, "strict": self.strict}
        return {"type": "function", "function": {key: value for key, value in function.items() if value is not None}}

    def body(self) -> dict:
        return {"type": "function", "name": self.name, "description": self.description, "parameters": self.parameters, "strict": self.strict}


class NamedFunction(StrictModel):
    type: Literal["function"]
    name: str


OUTPUT_LOGPROBS = "message.output_text.logprobs"
# Accepted and ignored in `include`: what the Codex CLI sends with every request that sets a
# reasoning effort, and vLLM accepts. graphrt's output has no reasoning items to encrypt, so there
# is nothing to include; refusing it would refuse every such client.
NOTHING_TO_INCLUDE = "reasoning.encrypted_content"


class StreamOptions(StrictModel):
    include_obfuscation: bool | None = None  # ignored: graphrt never pads events (see protocol.StreamOptions)


class ResponsesRequest(StrictModel):
    """A request body of `POST /v1/responses`, as OpenAI's SDK sends it."""

    model: str | None = None  # None: the served model
    input: str | list[InputItem]
    instructions: str | None = None  # a system message ahead of the input
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)  # 0 keeps only the most likely token: greedy
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    # Refused unless off: graphrt keeps no responses to continue from or to finish later.
    previous_response_id: str | None = None
    conversation_: str | dict[str, Any] | None = Field(None, alias="conversation")  # a stored conversation's id
    background: bool | None = None
    # Accepted and ignored, as the chat route does: none changes what graphrt generates.
    store: bool | None = None  # nothing is stored, whatever it says; a response says "store": false
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # prefix caching needs no key
    prompt_cache_retention: str | None = None
    service_tier: str | None = None
    reasoning: dict[str, Any] | None = None  # no chat template here takes a reasoning effort
    # "auto" lets OpenAI drop the conversation's first items to fit the context. graphrt drops
    # nothing, as vLLM: an input over the context is refused with the context-length error, which
    # the clients that send "auto" (the Agents SDK, LangChain) recognise.
    truncation: Literal["disabled", "auto"] | None = None
    # More output than the response holds by default: OUTPUT_LOGPROBS asks for the logprobs of the
    # output text's tokens, each with its `top_logprobs` most likely alternatives. As in vLLM, they
    # come only with that include: top_logprobs alone is accepted and asks for nothing.
    include: list[str] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @field_validator("input")
    @classmethod
    def _check_input(cls, value):
        if isinstance(value, list) and not value:
            raise ValueError("must not be empty; send a string or a list of input items")
        return value

    def check(self) -> None:
        """Checks across fields, after each field is valid on its own."""
        if self.previous_response_id is not None:
            raise APIError(
                400, "previous_response_id is not supported: graphrt stores no responses; send the whole conversation in input",
                param="previous_response_id",
            )
        if self.conversation_ is not None:
            raise APIError(400, "conversation is not supported: graphrt stores no conversations; send the whole conversation in input",
                           param="conversation")
        if self.background:
            raise APIError(400, "background is not supported: graphrt answers each request while it is open; send background: false", param="background")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options")
        if self.text is not None and self.text.format is not None:
            self.text.format.check()
        for value in self.include or []:
            if value not in (OUTPUT_LOGPROBS, NOTHING_TO_INCLUDE):
                raise APIError(
                    400, f"include: {value!r} is not supported; graphrt can include {OUTPUT_LOGPROBS!r} "
                    f"(and accepts {NOTHING_TO_INCLUDE!r}, which its output has none of)", param="include",
                )
        if isinstance(self.input, list):
            self._check_items()

    def _check_items(self) -> None:
        call_ids: set[str] = set()
        for index, item in enumerate(self.input):
            if isinstance(item, MessageItem) and not item.text and item.role != "assistant":
                raise APIError(400, f"input[{index}].content must not be empty", param=f"input[{index}].content")
            if isinstance(item, FunctionCallItem):
                call_ids.add(item.call_id)
            if isinstance(item, FunctionCallOutputItem) and item.call_id not in call_ids:
                raise APIError(
                    400, f"input[{index}].call_id: no function_call item before it has call_id {item.call_id!r}; "
                    "send the call ahead of its output", param=f"input[{index}].call_id",
                )

    @property
    def num_logprobs(self) -> int | None:
        """The alternatives each output token's logprobs list; None: the request asked for no logprobs."""
        return (self.top_logprobs or 0) if OUTPUT_LOGPROBS in (self.include or []) else None

    def conversation(self) -> list[tuple[str, dict]]:
        """The conversation in chat completions' shape, each message with the parameter it comes
        from. Consecutive calls go in one assistant message (with the text said just before them),
        as a chat model makes parallel calls; an assistant message that says nothing is left out
        (an earlier response's empty output, sent back)."""
        if isinstance(self.input, str):
            conversation = [("input", {"role": "user", "content": self.input})]
        else:
            conversation = []
            for index, item in enumerate(self.input):
                source = f"input[{index}]"
                if isinstance(item, MessageItem) and (item.text or item.role != "assistant"):
                    conversation.append((source, {"role": item.role, "content": item.text}))
                elif isinstance(item, FunctionCallItem):
                    call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
                    if not conversation or conversation[-1][1]["role"] != "assistant":
                        conversation.append((source, {"role": "assistant", "content": None}))
                    conversation[-1][1].setdefault("tool_calls", []).append(call)
                elif isinstance(item, FunctionCallOutputItem):
                    conversation.append((source, {"role": "tool", "tool_call_id": item.call_id, "content": item.text}))
        instructions = [("instructions", {"role": "system", "content": self.instructions})] if self.instructions is not None else []
        return instructions + conversation

    def chat_request(self) -> ChatCompletionRequest:
        """The chat completion request this one means, checked as the chat route checks its own
        (its errors in chat's terms: raise them within `in_own_terms`)."""
        messages = [message for _, message in self.conversation()]
        chat: dict[str, Any] = {"model": self.model, "messages": messages, "max_completion_tokens": self.max_output_tokens}
        for name in ("temperature", "top_p", "stream", "parallel_tool_calls"):
            if getattr(self, name) is not None:
                chat[name] = getattr(self, name)
        if self.text is not None and self.text.format is not None:
            chat["response_format"] = self.text.format.response_format()
        if self.num_logprobs is not None:
            chat["logprobs"], chat["top_logprobs"] = True, self.num_logprobs
        if self.tools is not None:
            chat["tools"] = [tool.chat_tool() for tool in self.tools]
        if isinstance(self.tool_choice, NamedFunction):
            chat["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            chat["tool_choice"] = self.tool_choice
        try:
            request = ChatCompletionRequest.model_validate(chat)
        except ValidationError as exc:
            raise validation_error(exc) from None
        request.check()
        return request

    @contextmanager
    def in_own_terms(self) -> Iterator[None]:
        """An APIError raised within, as the chat request raises it, naming this request's
        parameters instead: `text.format.schema` for `response_format.json_schema.schema`,
        `tools[0].parameters` for `tools[0].function.parameters`, `max_output_tokens` for
        `max_tokens`, `input[3]` for the message it became, `messages[4]`."""
        sources = [source for source, _ in self.conversation()]

        def message_source(found: re.Match) -> str:
            source = sources[int(found.group(1))] if int(found.group(1)) < len(sources) else "input"
            return source + (found.group(2) or "") if source.startswith("input[") else source

        def renamed(text: str) -> str:
            for pattern, replacement in _RESPONSES_NAMES:
                text = pattern.sub(replacement, text)
            return _MESSAGE.sub(message_source, text)

        try:
            yield
        except APIError as exc:
            raise APIError(exc.status, renamed(exc.message), param=exc.param and renamed(exc.param), code=exc.code) from None


# Chat's parameter names and the Responses request's for the same thing, most specific first.
_RESPONSES_NAMES = [
    (re.compile(r"response_format\.json_schema\b|response_format\b"), "text.format"),
    (re.compile(r"(tools\[\d+\])\.function\b"), r"\1"),
    (re.compile(r"tool_choice\.function\b"), "tool_choice"),
    (re.compile(r"\bmax_(completion_)?tokens\b"), "max_output_tokens"),  # the engine's length checks say max_tokens
]
_MESSAGE = re.compile(r"\bmessages\[(\d+)\](\.content\b)?")


def parse_responses_request(body: bytes) -> ResponsesRequest:
    """Decode, parse and validate a Responses request body; raise APIError(400) naming what is wrong."""
    raw = decode_body(body)
    check_tool_shapes(raw)
    try:
        request = ResponsesRequest.model_validate(raw)
    except ValidationError as exc:
        raise validation_error(exc) from None
    request.check()
    return request


def check_tool_shapes(raw: dict) -> None:
    """Chat's shapes of a tool and a named tool_choice, and OpenAI's built-in tools, named as such:
    validation alone would call them a missing `name` or a wrong `type`."""
    choice = raw.get("tool_choice")
    if isinstance(choice, dict):
        if "function" in choice and "name" not in choice:
            raise APIError(400, 'tool_choice: the Responses API names the function at the top, {"type": "function", "name": ...}; '
                           '{"function": {"name": ...}} is chat\'s shape', param="tool_choice")
        if choice.get("type", "function") != "function":
            raise APIError(400, f"tool_choice: type {choice['type']!r} is not served; send \"none\", \"auto\", \"required\" "
                           'or {"type": "function", "name": ...}', param="tool_choice")
    tools = raw.get("tools")
    for index, tool in enumerate(tools if isinstance(tools, list) else ()):
        if not isinstance(tool, dict):
            continue
        if tool.get("type", "function") != "function":
            raise APIError(400, f"tools[{index}].type: {tool['type']!r} is not served: graphrt runs none of OpenAI's built-in tools; "
                           "send function tools", param=f"tools[{index}].type")
        if "function" in tool and "name" not in tool:
            raise APIError(400, f'tools[{index}]: the Responses API takes a function tool flat, {{"type": "function", "name": ..., '
                           '"parameters": ...}}; {"function": {...}} is chat\'s shape', param=f"tools[{index}]")
