"""The JSON the OpenAI API answers with: whole responses, stream chunks and usage, per endpoint."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from graphrt.server.async_engine import ChoiceUpdate


@dataclass
class ChoiceState:
    """One choice as its tokens arrive, and how much of its text a stream has sent."""

    text: str = ""
    num_streamable: int = 0  # characters of `text` that can no longer change (see OutputProcessor)
    num_tokens: int = 0
    finish_reason: str | None = None
    first_at: float | None = None
    last_at: float | None = None
    num_sent: int = 0  # characters of `text` already streamed

    def apply(self, update: ChoiceUpdate) -> None:
        self.text, self.num_tokens, self.finish_reason = update.text, update.num_tokens, update.finish_reason
        self.num_streamable = update.num_streamable
        if self.first_at is None:
            self.first_at = update.at
        self.last_at = update.at

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def take_delta(self) -> str:
        """The text a stream may send now: what can no longer change (all of it once finished)."""
        end = len(self.text) if self.finished else self.num_streamable
        if end <= self.num_sent:
            return ""
        delta, self.num_sent = self.text[self.num_sent : end], end
        return delta


def usage(prompt_tokens: int, choices: list[ChoiceState]) -> dict:
    """The prompt counts once; completion tokens are summed over the choices."""
    completion_tokens = sum(c.num_tokens for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


class ResponseFormat:
    """What differs between /v1/completions and /v1/chat/completions is only the JSON's shape."""

    id_prefix = ""
    response_object = ""
    chunk_object = ""

    def __init__(self, model_id: str):
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model_id = model_id

    def _envelope(self, object_name: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model_id, "choices": choices}

    def response(self, prompt_tokens: int, choices: list[ChoiceState]) -> dict:
        body = self._envelope(self.response_object, [self.final_choice(i, c) for i, c in enumerate(choices)])
        body["usage"] = usage(prompt_tokens, choices)
        return body

    def chunk(self, choices: list[dict], include_usage: bool, usage_body: dict | None = None) -> dict:
        body = self._envelope(self.chunk_object, choices)
        if include_usage:
            body["usage"] = usage_body  # null on every chunk but the last, as OpenAI does
        return body

    def opening_choice(self, index: int) -> dict | None:
        return None

    def final_choice(self, index: int, choice: ChoiceState) -> dict:
        raise NotImplementedError

    def delta_choice(self, index: int, text: str, finish_reason: str | None) -> dict:
        raise NotImplementedError


class CompletionFormat(ResponseFormat):
    id_prefix = "cmpl"
    response_object = chunk_object = "text_completion"

    def final_choice(self, index: int, choice: ChoiceState) -> dict:
        return {"index": index, "text": choice.text, "logprobs": None, "finish_reason": choice.finish_reason}

    def delta_choice(self, index: int, text: str, finish_reason: str | None) -> dict:
        return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}


class ChatFormat(ResponseFormat):
    id_prefix = "chatcmpl"
    response_object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def opening_choice(self, index: int) -> dict | None:
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}

    def final_choice(self, index: int, choice: ChoiceState) -> dict:
        message = {"role": "assistant", "content": choice.text}
        return {"index": index, "message": message, "logprobs": None, "finish_reason": choice.finish_reason}

    def delta_choice(self, index: int, text: str, finish_reason: str | None) -> dict:
        delta = {"content": text} if text else {}
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
