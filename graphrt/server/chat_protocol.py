"""Chat completions' request body: messages (text parts, tool calls and their answers), the chat
template's options, tools and tool_choice, on top of what completions share (`SamplingFields`)."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, field_validator

from graphrt.sampling_params import MAX_LOGPROBS, StructuredOutput
from graphrt.server.errors import APIError
from graphrt.server.protocol import SamplingFields
from graphrt.server.tool_choice import Tool, ToolChoice, ToolUse
from graphrt.server.validation import StrictModel

# transformers' apply_chat_template's own arguments: not variables chat_template_kwargs may set.
TEMPLATE_ARGUMENTS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs",
})
# Chat content parts of OpenAI's (and vLLM's) for what a text-only model cannot read.
MEDIA_PARTS = ("image_url", "input_image", "input_audio", "audio_url", "video_url", "file")


def text_only(content, send: str):
    """A message's content as given, or a ValueError naming the first image, audio or file part in
    it: a text-only model cannot read them. `send`: what to send instead."""
    for part in content if isinstance(content, list) else ():
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in MEDIA_PARTS:
            raise ValueError(f"{kind} parts are not served: graphrt serves text-only models; send {send}")
    return content


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class ToolCallFunction(StrictModel):
    name: str
    arguments: str  # JSON, as the model wrote it


class ToolCall(StrictModel):
    id: str
    type: Literal["function"]
    function: ToolCallFunction

    def template_dict(self) -> dict:
        """As transformers' chat templates expect a call: its arguments as an object, not a JSON string
        (templates write them with `tojson`). Arguments that are not a JSON object (a model can write
        broken JSON) stay the string the model wrote."""
        try:
            arguments = json.loads(self.function.arguments)
        except (ValueError, RecursionError):
            arguments = None
        if not isinstance(arguments, dict):
            arguments = self.function.arguments
        return {"id": self.id, "type": self.type, "function": {"name": self.function.name, "arguments": arguments}}


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls, earlier in the conversation
    tool_call_id: str | None = None  # a tool message: the call whose result it carries

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content):
        return text_only(content, 'text parts (type "text")')

    def check(self, index: int) -> None:
        """What fits together in one message; raises APIError naming the field, e.g. `messages[2].content`."""
        field = lambda name: f"messages[{index}].{name}"  # noqa: E731
        if self.tool_calls is not None and self.role != "assistant":
            raise APIError(400, f"{field('tool_calls')}: only assistant messages make tool calls, not {self.role} messages", param=field("tool_calls"))
        if self.role == "tool" and self.tool_call_id is None:
            raise APIError(400, f"{field('tool_call_id')} is required: a tool message answers the call with that id", param=field("tool_call_id"))
        if self.role != "tool" and self.tool_call_id is not None:
            raise APIError(400, f"{field('tool_call_id')}: only tool messages answer a tool call, not {self.role} messages", param=field("tool_call_id"))
        if self.content is None and not self.tool_calls:
            needs = "unless the message has tool_calls" if self.role == "assistant" else f"in a {self.role} message"
            raise APIError(400, f"{field('content')} is required {needs}", param=field("content"))
        # As OpenAI: an empty message is a client bug, not a turn to template. A tool may return
        # nothing, and an assistant turn that made calls may say nothing.
        if self.content is not None and not self.content and not self.tool_calls and self.role != "tool":
            got = "an empty string" if isinstance(self.content, str) else "an empty list"
            raise APIError(400, f"{field('content')}: must be a non-empty string or a non-empty list of text parts, got {got}", param=field("content"))

    def template_dict(self) -> dict:
        """The message as transformers' chat templates expect it: plain text content, developer read
        as system, `tool_calls` on an assistant's calls and `tool_call_id` on a tool's result.

        Content null (an assistant turn that only made calls) becomes "", as vLLM does: templates
        that know tool calls render them and skip an empty text, and the others (SmolLM2's
        concatenates `message['content']`) render an empty assistant turn, not the text "None" or
        an error. transformers 5 drops null keys, so null never reaches a template either way.
        """
        if self.content is None:
            content = ""
        else:
            content = self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)
        message = {"role": "system" if self.role == "developer" else self.role, "content": content}
        if self.tool_calls:
            message["tool_calls"] = [call.template_dict() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class ChatTemplateOptions(StrictModel):
    """How the chat template renders a conversation (vLLM's and SGLang's fields, on chat and
    /tokenize): variables it reads (Qwen3's enable_thinking), and whether the prompt ends where the
    reply begins, after the last message, or inside it (the reply continues it)."""

    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def template_kwargs(self) -> dict[str, Any]:
        """What Tokenizer.apply_chat_template renders with besides the messages and tools; raise
        APIError(400) for a pair that contradicts itself or a variable that is an argument."""
        continuing = self.continue_final_message
        if continuing and "add_generation_prompt" in self.model_fields_set and self.add_generation_prompt:
            raise APIError(400, "continue_final_message and add_generation_prompt cannot both be true; send one", param="continue_final_message")
        taken = sorted(set(self.chat_template_kwargs or {}) & TEMPLATE_ARGUMENTS)
        if taken:
            raise APIError(
                400, f"chat_template_kwargs.{taken[0]} is an argument of the template call, not a variable of the template; "
                "send the request's own field (messages, tools, add_generation_prompt, continue_final_message) instead",
                param=f"chat_template_kwargs.{taken[0]}",
            )
        return {**(self.chat_template_kwargs or {}), "add_generation_prompt": self.add_generation_prompt and not continuing,
                "continue_final_message": continuing}


class ChatCompletionRequest(SamplingFields, ChatTemplateOptions):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # only with logprobs: true
    # Functions the model may call, and how (graphrt.server.tool_choice).
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None  # None: "auto" with tools
    parallel_tool_calls: bool | None = None  # None: true
    # Accepted and ignored: fields OpenAI's SDKs and LangChain send, none of which changes what
    # graphrt does.
    metadata: dict[str, str] | None = None  # tags for OpenAI's stored completions; graphrt stores none
    store: bool | None = None  # the same: nothing is stored
    service_tier: str | None = None  # OpenAI's priced tiers; one server is one tier
    reasoning_effort: str | None = None  # for OpenAI's reasoning models; no chat template here is given it
    verbosity: str | None = None  # the same
    safety_identifier: str | None = None  # an end-user id for OpenAI's abuse monitoring, as `user`
    prompt_cache_key: str | None = None  # OpenAI's cache routing; prefix caching needs no key
    prompt_cache_retention: str | None = None  # the same

    def check(self) -> None:
        super().check()
        self.template_kwargs()
        if None not in (self.max_tokens, self.max_completion_tokens) and self.max_tokens != self.max_completion_tokens:
            raise APIError(400, "max_tokens and max_completion_tokens disagree; give one of them", param="max_tokens")
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs is only allowed with logprobs: true", param="top_logprobs")
        tool_use = self.tool_use()
        if tool_use is not None and tool_use.constrains_output and super().structured_output() is not None:
            given = "structured_outputs" if self.structured_outputs is not None else "response_format"
            shown = f'"{self.tool_choice}"' if isinstance(self.tool_choice, str) else "naming a function"
            raise APIError(400, f"{given} and tool_choice {shown} both say what the output must be; send one", param=given)
        self.structured_output()  # what cannot be built is refused here, naming the tool
        if self.min_tokens and tool_use is not None and tool_use.constrains_output:
            raise APIError(400, "min_tokens cannot be combined with tool_choice \"required\" or a named tool: the grammar decides where the output ends", param="min_tokens")
        for index, message in enumerate(self.messages):
            message.check(index)

    def tool_use(self) -> ToolUse | None:
        """The tools the model may call and how; None where it calls none."""
        return ToolUse.of(self.tools, self.tool_choice, self.parallel_tool_calls)

    def structured_output(self) -> StructuredOutput | None:
        tool_use = self.tool_use()
        if tool_use is not None and tool_use.constrains_output:
            return tool_use.structured_output()
        return super().structured_output()

    def grammars(self) -> list[tuple[StructuredOutput, str]]:
        tool_use = self.tool_use()
        if tool_use is not None and tool_use.constrains_output:
            return tool_use.grammars()
        return super().grammars()

    def resolved_max_tokens(self) -> int | None:
        # None: up to the context length, as OpenAI's default for chat
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
