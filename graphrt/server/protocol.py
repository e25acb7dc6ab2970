"""Request bodies of the OpenAI API that graphrt serves, validated into `SamplingParams`.

Validation is strict, as OpenAI's own API is: no string-for-number coercion, no NaN, unknown
fields refused by name, numbers bounded to what the engine holds (top_k and seeds travel between
stages as int64). `parse_request` turns every problem into an `APIError` (400) that names the
parameter, so a bad request never reaches the engine, where it could fail the requests batched
with it.
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from graphrt.sampling import INT64_MAX, INT64_MIN, SamplingParams
from graphrt.server.errors import APIError

MAX_CHOICES = 128  # `n`: each choice is a sequence of its own in the engine
MAX_STOP_STRINGS = 16

# OpenAI parameters graphrt does not implement, with the values that mean "off" (clients often
# send those explicitly). Any other value is refused with a 400 naming the parameter.
UNSUPPORTED_PARAMS: dict[str, tuple] = {
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "parallel_tool_calls": (None,),
    "functions": (None, []),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
}


class StrictModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class StreamOptions(StrictModel):
    include_usage: bool = False


class SamplingFields(StrictModel):
    """What completions and chat completions share: the model, sampling, stopping and streaming."""

    model: str | None = None  # None: the served model
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1, le=INT64_MAX)  # 0 or -1: no limit; the sampler clamps it to the vocabulary
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX - MAX_CHOICES)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # an extension (as in vLLM): generate exactly max_tokens tokens
    user: str | None = None  # accepted and ignored, as an end-user id for OpenAI's abuse monitoring

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, stop):
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return stop

    def check(self) -> None:
        """Checks across fields, after each field is valid on its own."""
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def resolved_max_tokens(self) -> int | None:
        return self.max_tokens

    def sampling_params(self) -> list[SamplingParams]:
        """One SamplingParams per choice; with a seed, choice i draws from seed + i."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [
            SamplingParams(
                max_tokens=self.resolved_max_tokens(),
                temperature=self.temperature,
                top_k=max(self.top_k, 0),
                top_p=self.top_p,
                seed=None if self.seed is None else self.seed + index,
                stop=stop,
                ignore_eos=self.ignore_eos,
            )
            for index in range(self.n)
        ]


class CompletionRequest(SamplingFields):
    prompt: Any
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions

    @field_validator("prompt", mode="plain")
    @classmethod
    def _check_prompt(cls, prompt):
        """A string, a list of token ids, or a batch of one of those."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            raise ValueError("batches of prompts are not supported; send one prompt per request (use n for several choices)")
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return prompt
        raise ValueError("must be a string, a list of token ids, or a list holding one of those")


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _check_content(cls, content):
        if not content:  # as OpenAI: an empty message is a client bug, not a turn to template
            got = "an empty string" if isinstance(content, str) else "an empty list"
            raise ValueError(f"must be a non-empty string or a non-empty list of text parts, got {got}")
        return content

    def template_dict(self) -> dict:
        """The message as chat templates expect it: plain text content, developer read as system."""
        content = self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens

    def check(self) -> None:
        super().check()
        if None not in (self.max_tokens, self.max_completion_tokens) and self.max_tokens != self.max_completion_tokens:
            raise APIError(400, "max_tokens and max_completion_tokens disagree; give one of them", param="max_tokens")

    def resolved_max_tokens(self) -> int | None:
        # None: up to the context length, as OpenAI's default for chat
        return self.max_completion_tokens or self.max_tokens


def parse_request(body: bytes, model_cls: type[SamplingFields]) -> SamplingFields:
    """Decode, parse and validate a request body; raise APIError(400) naming what is wrong."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(400, f"the request body is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
    raw = decode_json(text)
    if not isinstance(raw, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(raw).__name__}")
    check_unicode(raw)
    for name, off_values in UNSUPPORTED_PARAMS.items():
        if name in raw:
            value = raw.pop(name)
            if not any(value == off and type(value) is type(off) for off in off_values):
                raise APIError(400, f"{name} is not supported by graphrt; remove it from the request", param=name)
    try:
        request = model_cls.model_validate(raw)
    except ValidationError as exc:
        raise validation_error(exc) from None
    request.check()
    return request


def decode_json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise APIError(400, f"the request body is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    except RecursionError:
        raise APIError(400, "the request body nests arrays or objects too deeply to parse; no parameter needs more than a few levels") from None
    except ValueError:  # Python's limit on int-string conversion (CVE-2020-10735)
        raise APIError(
            400, f"the request body holds an integer with more than {sys.get_int_max_str_digits()} digits; "
            f"no parameter takes one beyond {INT64_MAX}"
        ) from None


def check_unicode(raw: dict) -> None:
    """Refuse a lone UTF-16 surrogate (JSON allows the escape "\\ud800"): no tokenizer can encode it,
    nor can an error message that quotes it. Walks without recursion, as the body may nest deeply."""
    pending: list[tuple[str, Any]] = [("", raw)]
    while pending:
        path, value = pending.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                if not _is_unicode(key):
                    raise APIError(400, f"a key {'in ' + path if path else 'of the request'} holds a lone UTF-16 surrogate ({ascii(key)}); "
                                   "send valid Unicode, with surrogates only in pairs", param=path or None)
                pending.append((f"{path}.{key}" if path else key, item))
        elif isinstance(value, list):
            pending.extend((f"{path}[{index}]", item) for index, item in enumerate(value))
        elif isinstance(value, str) and not _is_unicode(value):
            position = next(i for i, char in enumerate(value) if "\ud800" <= char <= "\udfff")
            raise APIError(400, f"{path}: holds a lone UTF-16 surrogate ({ascii(value[position])} at character {position}); "
                           "send valid Unicode, with surrogates only in pairs", param=path)


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


# pydantic puts the union member it tried into the error location; those are not parameter names
_TYPE_TAG = re.compile(r"^(str|int|float|bool|list|dict|none)$|[\[\-]")


def validation_error(exc: ValidationError) -> APIError:
    """The first validation problem as a 400 that names the parameter, e.g. `messages[0].role`.

    Of a union's errors, the deepest says most (an image part: its `type`, not "not a string").
    """
    errors = exc.errors()
    error = max((e for e in errors if e["loc"][:1] == errors[0]["loc"][:1]), key=lambda e: len(e["loc"]))
    param = ""
    for part in error["loc"]:
        if isinstance(part, int):
            param += f"[{part}]"
        elif not _TYPE_TAG.search(part):
            param += f".{part}" if param else part
    if error["type"] == "extra_forbidden":
        return APIError(400, f"unrecognized request argument: {param}", param=param)
    if error["type"] == "missing":
        return APIError(400, f"{param} is required", param=param)
    message = error["msg"].removeprefix("Value error, ")
    return APIError(400, f"{param}: {message}" if param else message, param=param or None)
