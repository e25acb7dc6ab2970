"""vLLM's /tokenize and /detokenize: the token ids the completions and chat routes feed
the model for a prompt or a conversation (to count them before sending), text back from ids."""

from __future__ import annotations

import asyncio

from pydantic import Field, ValidationError, model_validator

from graphrt.errors import GraphrtError
from graphrt.server.chat_protocol import ChatMessage, ChatTemplateOptions
from graphrt.server.errors import APIError
from graphrt.server.tool_choice import Tool, ToolUse
from graphrt.server.validation import StrictModel, validation_error


class TokenizeRequest(ChatTemplateOptions):
    """A prompt as completions tokenize it, or messages (and tools) as chat renders them; vLLM's
    fields, but chat_template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    tools: list[Tool] | None = None
    add_special_tokens: bool | None = None  # None: yes for a prompt (its BOS), no for messages (the template writes them)
    return_token_strs: bool = False  # also each id as the tokenizer's piece

    @model_validator(mode="after")
    def _one_of_prompt_and_messages(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt (text) and messages (a conversation)")
        if self.tools is not None and self.messages is None:
            raise ValueError("tools go with messages: a plain prompt has no chat template to show them")
        if (self.continue_final_message or self.chat_template_kwargs) and self.messages is None:
            raise ValueError("continue_final_message and chat_template_kwargs go with messages: a plain prompt has no chat template")
        return self


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[int]


async def tokenize(tokenizer, parsed: TokenizeRequest, max_model_len: int, model_id: str) -> dict:
    """What vLLM answers: the ids, their count and the context length they must fit."""
    if tokenizer is None:
        raise APIError(400, f"{model_id} has no tokenizer: its prompts are token ids already")
    special = parsed.add_special_tokens if parsed.add_special_tokens is not None else parsed.messages is None
    try:
        if parsed.messages is not None:
            messages = [message.template_dict() for message in parsed.messages]
            tools = ToolUse.of(parsed.tools, None, None).template_tools() if parsed.tools else None
            text = await asyncio.to_thread(tokenizer.apply_chat_template, messages, tools, **parsed.template_kwargs())
        else:
            text = parsed.prompt
        ids = await asyncio.to_thread(tokenizer.encode, text, special)
    except GraphrtError as exc:  # the chat template refused the conversation, or there is none
        raise APIError(400, str(exc)) from None
    token_strs = tokenizer.token_strs(ids) if parsed.return_token_strs else None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": token_strs}


async def detokenize(tokenizer, parsed: DetokenizeRequest, model_id: str) -> dict:
    if tokenizer is None:
        raise APIError(400, f"{model_id} has no tokenizer to spell token ids with")
    vocab_size = tokenizer.vocab_size
    outside = next((token for token in parsed.tokens if not 0 <= token < vocab_size), None)
    if outside is not None:
        raise APIError(400, f"tokens: {outside} is outside the tokenizer's vocabulary [0, {vocab_size})", param="tokens")
    # As vLLM's: the text of every id, special tokens too.
    return {"prompt": await asyncio.to_thread(tokenizer.decode, parsed.tokens, False)}


def parse(body: dict, model_cls: type[StrictModel]) -> StrictModel:
    try:
        return model_cls.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None

