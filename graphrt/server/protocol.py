"""Request bodies of the OpenAI API that graphrt serves, validated into `SamplingParams`: what
completions and chat share (`SamplingFields`), the completions request, and reading one
(`parse_request`, after body.py's `decode_body`). Chat's messages and request are in chat_protocol.py.

Validation is strict, as OpenAI's own API is: no string-for-number coercion, no NaN, unknown
fields refused by name, numbers bounded to what the engine holds (top_k and seeds travel between
stages as int64). `parse_request` turns every problem into an `APIError` (400) that names the
parameter, so a bad request never reaches the engine, where it could fail the requests batched
with it.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

from pydantic import Field, ValidationError, field_validator, model_validator

from graphrt.sampling_params import (
    INT64_MAX,
    INT64_MIN,
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_PENALTY,
    SamplingParams,
    StructuredOutput,
)
from graphrt.server.body import decode_body
from graphrt.server.errors import APIError
from graphrt.server.structured_outputs import ResponseFormatParam, StructuredOutputsParam
from graphrt.server.validation import RENAMED, StrictModel, validation_error

MAX_CHOICES = 128  # sequences per request (prompts x n): each is a sequence of its own in the engine
MAX_STOP_STRINGS = 16

# OpenAI parameters graphrt does not implement, with the values that mean "off" (clients often
# send those explicitly). Any other value is refused with a 400 naming the parameter.
UNSUPPORTED_PARAMS: dict[str, tuple] = {
    "best_of": (None, 1),
    "suffix": (None, ""),
    "functions": (None, []),
    "function_call": (None, "none"),
}


class StreamOptions(StrictModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries the usage so far
    # Ignored. OpenAI pads streamed chunks with random characters against length side channels on
    # shared networks; graphrt never adds them, which is what `false` asks for.
    include_obfuscation: bool | None = None


# SGLang's top-level names for a structured output, and the structured_outputs kind each is.
SGLANG_STRUCTURED = {"regex": "regex", "ebnf": "grammar", "json_schema": "json"}


class SamplingFields(StrictModel):
    """What completions and chat completions share: the model, sampling, stopping and streaming."""

    # Fields whose null means something other than their default, and what it means.
    NULL_MEANS: ClassVar[dict[str, Any]] = {}

    model: str | None = None  # None: the served model
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, ge=0, le=1)  # 0 keeps only the most likely token: greedy
    top_k: int = Field(0, ge=-1, le=INT64_MAX)  # 0 or -1: no limit; the sampler clamps it to the vocabulary
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX - MAX_CHOICES)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # an extension (as in vLLM): generate exactly max_tokens tokens
    return_token_ids: bool | None = None  # vLLM's: the prompt's and the output's token ids beside the text (null: no)
    include_stop_str_in_output: bool | None = None  # vLLM's: the text keeps the stop string that ended it (null: no)
    user: str | None = None  # accepted and ignored, as an end-user id for OpenAI's abuse monitoring
    # What is done to the logits (graphrt.sampling_params); null means the default, as SDKs send it.
    presence_penalty: float | None = None  # OpenAI's, in [-2, 2]
    frequency_penalty: float | None = None  # OpenAI's, in [-2, 2]
    logit_bias: dict[str, float] | None = None  # OpenAI's: token id (as a string) -> bias in [-100, 100]
    # vLLM's extensions
    repetition_penalty: float | None = None  # > 0; 1 is off
    min_p: float | None = None  # in [0, 1]
    min_tokens: int | None = Field(None, ge=0)
    prompt_logprobs: int | None = None  # each prompt token's logprob and this many alternatives, unstreamed
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    skip_special_tokens: bool = True  # False keeps the tokenizer's special tokens in the text
    # What the output must be (graphrt.server.structured_outputs): OpenAI's, and vLLM's extension.
    response_format: ResponseFormatParam | None = None
    structured_outputs: StructuredOutputsParam | None = None

    @model_validator(mode="before")
    @classmethod
    def _read_as_sent(cls, data):
        """A null is the field left out, as OpenAI's SDKs send it (`temperature: null` is the
        default temperature), but where null has a meaning of its own (NULL_MEANS); SGLang's
        `regex`, `ebnf` and `json_schema` are structured_outputs (null: not given)."""
        if not isinstance(data, dict):
            return data
        keep = cls.NULL_MEANS.keys() | SGLANG_STRUCTURED.keys()
        data = {key: value for key, value in data.items() if value is not None or key not in cls.model_fields or key in keep}
        for key, value in cls.NULL_MEANS.items():
            if key in data and data[key] is None:
                data[key] = value
        sglang = {kind: data.pop(key) for key, kind in SGLANG_STRUCTURED.items() if key in data}
        sglang = {kind: value for kind, value in sglang.items() if value is not None}
        if sglang:
            given = data.get("structured_outputs")
            if isinstance(given, dict) and given.keys() & sglang.keys():
                raise ValueError(f"structured_outputs.{next(iter(given.keys() & sglang.keys()))} is given twice (once at the top of the request, SGLang's way); send it once")
            data["structured_outputs"] = {**given, **sglang} if isinstance(given, dict) else sglang
        return data

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, stop):
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return stop

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _check_penalty(cls, value):
        if value is not None and not -MAX_PENALTY <= value <= MAX_PENALTY:
            raise ValueError(f"must be in [{-MAX_PENALTY:g}, {MAX_PENALTY:g}] (0 is off), got {value}")
        return value

    @field_validator("repetition_penalty")
    @classmethod
    def _check_repetition_penalty(cls, value):
        if value is not None and not value > 0:
            raise ValueError(f"must be greater than 0 (1 is off; above 1 discourages repeating), got {value}")
        return value

    @field_validator("min_p")
    @classmethod
    def _check_min_p(cls, value):
        if value is not None and not 0 <= value <= 1:
            raise ValueError(f"must be in [0, 1] (0 is off), got {value}")
        return value

    @field_validator("prompt_logprobs")
    @classmethod
    def _check_prompt_logprobs(cls, value):
        if value == -1:
            raise ValueError(f"-1 (every token of the vocabulary) is not served; ask for at most {MAX_LOGPROBS} alternatives")
        if value is not None and not 0 <= value <= MAX_LOGPROBS:
            raise ValueError(f"must be in [0, {MAX_LOGPROBS}] (alternatives per prompt token), got {value}")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, bias):
        for key, value in (bias or {}).items():
            if not re.fullmatch(r"[0-9]{1,19}", key) or int(key) > INT64_MAX:
                raise ValueError(f"keys must be token ids (integers >= 0, as strings), got {key!r}")
            if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise ValueError(f"the bias of token {key} must be in [{-MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {value}")
        return bias

    @field_validator("stop_token_ids", "allowed_token_ids")
    @classmethod
    def _check_token_ids(cls, ids, info):
        if ids is None:
            return ids
        if info.field_name == "allowed_token_ids" and not ids:
            raise ValueError("must hold at least one token id (leave it out to allow every token)")
        bad = [t for t in ids if not 0 <= t <= INT64_MAX]
        if bad:
            raise ValueError(f"token ids are integers >= 0, got {bad[0]}")
        return ids

    @field_validator("bad_words")
    @classmethod
    def _check_bad_words(cls, words):
        if words is not None:
            if len(words) > MAX_BAD_WORDS:
                raise ValueError(f"at most {MAX_BAD_WORDS} words, got {len(words)}")
            if any(not w.strip() for w in words):
                raise ValueError("words must not be empty or blank")
        return words

    def check(self) -> None:
        """Checks across fields, after each field is valid on its own."""
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options")
        if self.prompt_logprobs and self.stream:  # as vLLM: 0 asks for no alternatives, and streams
            raise APIError(
                400, "prompt_logprobs are not available with stream: true (as in vLLM); ask without streaming, or "
                "for a completion send echo: true with logprobs", param="prompt_logprobs",
            )
        max_tokens = self.resolved_max_tokens()
        if self.min_tokens and max_tokens is not None and self.min_tokens > max_tokens:
            raise APIError(400, f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({max_tokens})", param="min_tokens")
        for constraint in (self.response_format, self.structured_outputs):
            if constraint is not None:
                constraint.check()
        if self.structured_outputs is not None and self.response_format is not None and self.response_format.type != "text":
            raise APIError(400, "response_format and structured_outputs both say what the output must be; send one", param="structured_outputs")
        # This class's grammar, not a chat request's (which counts its tools: ChatCompletionRequest.check).
        if self.min_tokens and SamplingFields.structured_output(self) is not None:
            given = "structured_outputs" if self.structured_outputs is not None else "response_format"
            raise APIError(400, f"min_tokens cannot be combined with {given}: the grammar decides where the output ends", param="min_tokens")

    def structured_output(self) -> StructuredOutput | None:
        """The grammar the output is held to, if any."""
        if self.structured_outputs is not None:
            return self.structured_outputs.structured_output()
        return self.response_format.structured_output() if self.response_format is not None else None

    def grammars(self) -> list[tuple[StructuredOutput, str]]:
        """Each grammar of the request with the parameter that gave it, for the engine's checks
        (graphrt.server.structured_outputs.check_grammar), which name that parameter."""
        for constraint in (self.structured_outputs, self.response_format):
            spec = constraint.structured_output() if constraint is not None else None
            if spec is not None:
                return [(spec, constraint.param)]
        return []

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats

    def resolved_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """Log-probabilities the response reports for each generated token: None for none (the
        choice's `logprobs` is null); k for the chosen token's own and its k most likely alternatives."""
        return None

    @property
    def num_prompt_logprobs(self) -> int | None:
        """As `num_logprobs`, for each prompt token after the first (vLLM's prompt_logprobs)."""
        return self.prompt_logprobs

    def sampling_params(self, keep_special_tokens: bool = False, defaults: dict | None = None) -> list[SamplingParams]:
        """One SamplingParams per choice; with a seed, choice i draws from seed + i.
        `keep_special_tokens`: the server's, whatever the request says (a tool-call parser reads them).
        `defaults`: the model's sampling defaults (graphrt.frontend.generation_config), for the keys
        the request leaves out or sends as null."""
        defaults = defaults or {}

        def given_or_default(name: str):
            value = getattr(self, name)
            return defaults[name] if name in defaults and (name not in self.model_fields_set or value is None) else value

        temperature, top_p, top_k = (given_or_default(name) for name in ("temperature", "top_p", "top_k"))
        min_p, repetition_penalty = given_or_default("min_p"), given_or_default("repetition_penalty")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        structured_output = self.structured_output()  # one for every choice: the engine compiles it once
        greedy = top_p == 0  # the sampler's greedy path; its top_p must be in (0, 1]
        return [
            SamplingParams(
                max_tokens=self.resolved_max_tokens(),
                temperature=0.0 if greedy else temperature,
                top_k=max(top_k, 0),
                top_p=1.0 if greedy else top_p,
                seed=None if self.seed is None else self.seed + index,
                stop=stop,
                include_stop_str_in_output=bool(self.include_stop_str_in_output),
                ignore_eos=self.ignore_eos,
                logprobs=self.num_logprobs,
                prompt_logprobs=self.num_prompt_logprobs,
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=1.0 if repetition_penalty is None else repetition_penalty,
                min_p=min_p or 0.0,
                min_tokens=self.min_tokens or 0,
                logit_bias={int(token): bias for token, bias in self.logit_bias.items()} if self.logit_bias else None,
                stop_token_ids=list(self.stop_token_ids or []),
                bad_words=list(self.bad_words or []),
                allowed_token_ids=self.allowed_token_ids,
                skip_special_tokens=self.skip_special_tokens and not keep_special_tokens,
                structured_output=structured_output,
            )
            for index in range(self.n)
        ]


class CompletionRequest(SamplingFields):
    """`prompt` is one prompt (text or token ids) or a batch of them; `prompts()` lists them either way.

    Each prompt gets `n` choices, which the response indexes prompt_index * n + choice_index, as
    OpenAI does. Every prompt samples with the same `sampling_params()` (choice i from seed + i), so
    a prompt generates in a batch what it generates alone.
    """

    NULL_MEANS: ClassVar[dict[str, Any]] = {"max_tokens": None}  # as vLLM: up to the context

    prompt: Any  # after validation: a str or list[int] (one prompt), or a list of two or more of those
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False  # each choice's text begins with its prompt (and its logprobs, with `logprobs`)

    @field_validator("logprobs", mode="before")
    @classmethod
    def _logprobs_is_a_count(cls, logprobs):
        if isinstance(logprobs, bool):
            raise ValueError(f"on completions, the number of alternatives per token: an integer in [0, {MAX_LOGPROBS}] "
                             "(true or false, with top_logprobs, is chat's form)")
        return logprobs

    @field_validator("prompt", mode="plain")
    @classmethod
    def _check_prompt(cls, prompt):
        """A string, a list of token ids, or a batch: a list of strings or of token-id lists."""
        shapes = "a string, a list of token ids, a list of strings, or a list of token-id lists"
        if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(is_token_id(t) for t in prompt)):
            return prompt
        if not isinstance(prompt, list):
            raise ValueError(f"must be {shapes}")
        if not prompt:
            raise ValueError(f"must not be empty; send {shapes}")
        if not all(isinstance(p, str) for p in prompt) and not all(isinstance(p, list) for p in prompt):
            raise ValueError(f"must be {shapes}, not a mix of those")
        for index, element in enumerate(prompt):
            if isinstance(element, list) and not (element and all(is_token_id(t) for t in element)):
                raise ValueError(f"element {index} must be a non-empty list of token ids (integers)")
        return prompt[0] if len(prompt) == 1 else prompt

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts in order; one element for a single prompt."""
        if isinstance(self.prompt, str) or is_token_id(self.prompt[0]):
            return [self.prompt]
        return list(self.prompt)

    def check(self) -> None:
        super().check()
        num_prompts = len(self.prompts())
        if num_prompts * self.n > MAX_CHOICES:
            raise APIError(
                400, f"prompt holds {num_prompts} prompts, which with n={self.n} make {num_prompts * self.n} sequences, more "
                f"than the {MAX_CHOICES} one request may ask for; send fewer prompts per request or lower n", param="prompt",
            )

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def num_prompt_logprobs(self) -> int | None:
        """The most either asks for: echo with logprobs, or prompt_logprobs (each response lists its own)."""
        asked = [k for k in (self.logprobs if self.echo else None, self.prompt_logprobs) if k is not None]
        return max(asked, default=None)


def is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_request(body: bytes, model_cls: type[SamplingFields]) -> SamplingFields:
    """Decode, parse and validate a request body; raise APIError(400) naming what is wrong."""
    raw = decode_body(body)
    for name, off_values in UNSUPPORTED_PARAMS.items():
        if name in raw:
            value = raw.pop(name)
            if not any(value == off and type(value) is type(off) for off in off_values):
                raise APIError(400, f"{name} is not supported by graphrt; remove it from the request", param=name)
    try:
        request = model_cls.model_validate(raw)
    except ValidationError as exc:
        raise validation_error(exc, RENAMED) from None
    request.check()
    return request
