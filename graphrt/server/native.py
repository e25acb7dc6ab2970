"""SGLang's native API, for the scripts and clients written against it: POST /generate in its
request and response shapes (streamed as SGLang streams: each event the whole output so far),
GET /health_generate, /get_model_info and /get_server_info.

A /generate request is read as the completions requests it amounts to (`completion_requests`), so its
checks, sampling and engine path are completions'; only the names differ, and an error names the
parameter as this request sent it (`in_native_terms`).
"""

from __future__ import annotations

import re
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Any, Iterator

from pydantic import ValidationError

from graphrt.frontend.async_engine import GenerationJob
from graphrt.sampling_params import TokenLogprob
from graphrt.server.errors import APIError
from graphrt.server.protocol import MAX_CHOICES, CompletionRequest, is_token_id
from graphrt.server.responses import ChoiceState, ResponseFormat, TokenNames
from graphrt.server.validation import RENAMED, validation_error

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's
# SGLang's request fields for what graphrt does not serve, and what to do instead.
UNSERVED = {
    "image_data": "graphrt serves text-only models",
    "audio_data": "graphrt serves text-only models",
    "video_data": "graphrt serves text-only models",
    "input_embeds": "send text or input_ids",
    "lora_path": "graphrt serves no LoRA adapters",
    "return_hidden_states": "graphrt returns no hidden states",
    "custom_logit_processor": "send logit_bias, bad_words or allowed_token_ids to /v1/completions instead",
}
# sampling_params' names that completions spells otherwise; the rest are completions' own.
SAMPLING_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "no_stop_trim": "include_stop_str_in_output"}
SAMPLING_FIELDS = (
    *SAMPLING_NAMES, "stop", "stop_token_ids", "temperature", "top_p", "top_k", "min_p", "frequency_penalty",
    "presence_penalty", "repetition_penalty", "ignore_eos", "skip_special_tokens", "n", "json_schema", "regex", "ebnf",
)


@dataclass(frozen=True)
class NativeOptions:
    """A /generate request's own fields beside its prompt and sampling_params, checked."""

    prompt_field: str = "text"  # what the prompt came as: "text" or "input_ids"
    batch: bool = False  # a list of prompts: the answer is a list
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1  # from where the prompt's logprobs are returned; below 0, none
    return_text_in_logprobs: bool = False
    rid: str | list[str] | None = None

    @classmethod
    def read(cls, raw: dict, prompt_field: str) -> NativeOptions:
        given = {f.name: raw[f.name] for f in fields(cls) if f.name in raw and raw[f.name] is not None and f.name not in ("prompt_field", "batch")}
        for name, value in given.items():
            kind = {"top_logprobs_num": int, "logprob_start_len": int}.get(name, bool)
            if name == "rid":
                if not (isinstance(value, str) or isinstance(value, list) and all(isinstance(r, str) for r in value)):
                    raise APIError(400, f"rid: must be a string, or a list of one per prompt, got {value!r}", param="rid")
            elif type(value) is not kind:
                raise APIError(400, f"{name}: must be a{'n integer' if kind is int else ' boolean'}, got {value!r}", param=name)
        prompt = raw[prompt_field]
        return cls(prompt_field=prompt_field, batch=isinstance(prompt, list) and not all(is_token_id(t) for t in prompt), **given)


def completion_requests(raw: dict) -> tuple[list[tuple[CompletionRequest, str]], NativeOptions]:
    """`raw` (a /generate body) as the completions requests it amounts to, each with where its
    sampling parameters are (`sampling_params`, or `sampling_params[1]`), and the request's own
    options: one request, or with a list of sampling_params (one per prompt) one per prompt, in order.
    Raises APIError(400) naming what is wrong, in the request's names."""
    known = {"text", "input_ids", "sampling_params", *(f.name for f in fields(NativeOptions))} - {"prompt_field", "batch"}
    unknown = sorted(set(raw) - known)
    if unknown:
        name = unknown[0]
        advice = ("put it in sampling_params" if name in SAMPLING_FIELDS else UNSERVED.get(name) or RENAMED.get(name))
        raise APIError(400, f"unrecognized request argument: {name}" + (f"; {advice}" if advice else ""), param=name)
    given = [name for name in ("text", "input_ids") if raw.get(name) is not None]
    if len(given) != 1:
        raise APIError(400, "give exactly one of text (a prompt, or a list of them) and input_ids (token ids, or a list of them)", param="text")
    prompt = raw[given[0]]
    _check_prompt(given[0], prompt)
    options = NativeOptions.read(raw, given[0])
    sampling = raw.get("sampling_params")
    if not isinstance(sampling, list):
        return [(_request(prompt, sampling, options, "sampling_params"), "sampling_params")], options
    if not options.batch or len(sampling) != len(prompt):
        prompts = f"{len(prompt)} prompts" if options.batch else "one prompt"
        raise APIError(400, f"sampling_params: a list must hold one object per prompt ({prompts}), got {len(sampling)}; "
                       "or send one object for every prompt", param="sampling_params")
    wheres = [f"sampling_params[{i}]" for i in range(len(sampling))]
    requests = [_request([one], params, options, where) for one, params, where in zip(prompt, sampling, wheres)]
    if len({r.n for r in requests}) > 1:
        raise APIError(400, "sampling_params: n must be the same for every prompt", param="sampling_params")
    if len(requests) * requests[0].n > MAX_CHOICES:
        raise APIError(400, f"{len(requests)} prompts x n = {requests[0].n} is more outputs than the {MAX_CHOICES} one request "
                       "may ask for; send fewer prompts per request or lower n", param="sampling_params")
    return list(zip(requests, wheres)), options


def _request(prompt, sampling, options: NativeOptions, where: str) -> CompletionRequest:
    """One completions request: `prompt` with the sampling parameters found at `where`."""
    sampling = {} if sampling is None else sampling
    if not isinstance(sampling, dict):
        raise APIError(400, f"{where} must be an object of sampling parameters, got {sampling!r}", param=where)
    for name in sampling:
        if name not in SAMPLING_FIELDS:
            raise APIError(400, f"{where}.{name} is not a sampling parameter served here; the served ones are "
                           f"{', '.join(SAMPLING_FIELDS)}", param=f"{where}.{name}")
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": DEFAULT_MAX_NEW_TOKENS, "stream": options.stream}
    body.update({SAMPLING_NAMES.get(name, name): value for name, value in sampling.items() if value is not None})
    if options.return_logprob:
        body["logprobs"] = options.top_logprobs_num
        if options.logprob_start_len >= 0:
            body["prompt_logprobs"] = options.top_logprobs_num
    with in_native_terms(options.prompt_field, where):
        try:
            request = CompletionRequest.model_validate(body)
        except ValidationError as exc:
            raise validation_error(exc) from None
        request.check()
    return request


def _check_prompt(name: str, prompt) -> None:
    """text: a string or a list of them; input_ids: ids, or a list of id lists."""
    if name == "text":
        fits = isinstance(prompt, str) or isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt)
        shapes = "a string or a non-empty list of strings"
    else:
        fits = isinstance(prompt, list) and prompt and (
            all(map(is_token_id, prompt)) or all(isinstance(p, list) and p and all(map(is_token_id, p)) for p in prompt)
        )
        shapes = "a non-empty list of token ids, or a list of them"
    if not fits:
        raise APIError(400, f"{name}: must be {shapes}", param=name)


@contextmanager
def in_native_terms(prompt_field: str, sampling: str = "sampling_params") -> Iterator[None]:
    """An APIError raised within, as completions raises it, naming what a /generate request sent:
    `sampling_params.max_new_tokens` for `max_tokens` (`sampling_params[1].max_new_tokens` where
    `sampling` names the second prompt's), `top_logprobs_num` for `logprobs`, `text` (or
    `input_ids`) for `prompt`. The parameter is renamed where the error names it, and in its text
    only the identifiers no prose or schema path spells alike (max_tokens, structured_outputs.regex...)."""
    try:
        yield
    except APIError as exc:
        param = _native_param(exc.param, prompt_field, sampling) if exc.param else exc.param
        message = exc.message
        if exc.param and param != exc.param:
            message = re.sub(rf"(?<![.\w]){re.escape(exc.param)}(?![\w])", param, message, count=1)
        for pattern, replacement in _IDENTIFIERS:
            message = pattern.sub(lambda _: _in(replacement, sampling), message)
        raise APIError(exc.status, message, param=param, code=exc.code) from None


def _native_param(param: str, prompt_field: str, sampling: str = "sampling_params") -> str:
    head, separator, rest = param.partition("[")
    if head == "prompt":
        return prompt_field + separator + rest
    if param in _PARAMS:
        return _in(_PARAMS[param], sampling)
    return f"{sampling}.{param}" if param in SAMPLING_FIELDS else param


def _in(name: str, sampling: str) -> str:
    """`name` (sampling_params.x) in the sampling parameters at `sampling` (sampling_params[1].x)."""
    return sampling + name[len("sampling_params"):] if name.startswith("sampling_params") else name


# completions' parameter -> what /generate calls it (the logprobs counts come from top_logprobs_num).
_PARAMS = {
    **{ours: f"sampling_params.{theirs}" for theirs, ours in SAMPLING_NAMES.items()},
    "logprobs": "top_logprobs_num", "prompt_logprobs": "top_logprobs_num",
    "structured_outputs.grammar": "sampling_params.ebnf", "structured_outputs.json": "sampling_params.json_schema",
    "structured_outputs.regex": "sampling_params.regex", "structured_outputs": "sampling_params",
}
_IDENTIFIERS = [
    (re.compile(rf"(?<![.\w]){re.escape(ours)}(?![\w])"), theirs)
    for ours, theirs in _PARAMS.items() if "_" in ours and ours != "structured_outputs"
]


class NativeFormat(ResponseFormat):
    """SGLang's /generate output: per choice `text`, `output_ids` and `meta_info` (its id, a
    finish_reason object, token counts, latency, and with return_logprob the logprobs as
    [logprob, token id, text or null] triples). One object for one prompt and n = 1, else a list."""

    def __init__(self, request: CompletionRequest, options: NativeOptions, names: TokenNames):
        super().__init__("", request.num_logprobs, names)
        self.batch = options.batch or request.n > 1
        self.text_in_logprobs = options.return_text_in_logprobs
        self.prompt_start = options.logprob_start_len if request.num_prompt_logprobs is not None else None
        self.rids = options.rid if isinstance(options.rid, list) else None
        self.rid = options.rid if isinstance(options.rid, str) else None
        self.job: GenerationJob | None = None
        self.scored: dict[int, list] = {}  # each choice's output logprobs so far

    def start(self, job: GenerationJob, choices: list[ChoiceState]) -> None:
        super().start(job, choices)
        self.job = job
        self.ids = [self._id(index) for index in range(len(choices))]

    def _id(self, index: int) -> str:
        if self.rids is not None and index < len(self.rids):
            return str(self.rids[index])
        if self.rid is not None:
            return self.rid if len(self.job.params) == 1 else f"{self.rid}-{index}"
        return uuid.uuid4().hex

    def response(self, prompt_tokens: int, choices: list[ChoiceState]) -> dict | list[dict]:
        outputs = [self.output(index, choice, choice.text) for index, choice in enumerate(choices)]
        return outputs if self.batch else outputs[0]

    def chunk(self, choices: list[dict], include_usage: bool, usage_body: dict | None = None) -> dict:
        return choices[0]

    def delta_choice(self, index: int, choice: ChoiceState, text: str) -> dict:
        body = self.output(index, choice, choice.text[: choice.num_sent])
        if self.batch:
            body["index"] = index
        return body

    def output(self, index: int, choice: ChoiceState, text: str) -> dict:
        prompt_ids = self.job.prompt_ids[self.job.prompt_index(index)]
        meta = {
            "id": self.ids[index], "finish_reason": self.finish_reason(choice), "prompt_tokens": len(prompt_ids),
            "completion_tokens": choice.num_tokens, "e2e_latency": (choice.last_at or self.job.arrived_at) - self.job.arrived_at,
        }
        if self.with_logprobs:
            scored = self.scored.setdefault(index, [])
            scored += choice.take_scored()
            meta["output_token_logprobs"] = [self.triple(entry.logprob, token_id) for token_id, entry in scored]
            meta["output_top_logprobs"] = [self.top(entry) for _, entry in scored]
            if self.prompt_start is not None:
                start = min(self.prompt_start, len(prompt_ids))
                entries = (choice.prompt_logprobs or [None] * len(prompt_ids))[start:]
                meta["input_token_logprobs"] = [
                    self.triple(None if entry is None else entry.logprob, token_id) for token_id, entry in zip(prompt_ids[start:], entries)
                ]
                meta["input_top_logprobs"] = [None if entry is None else self.top(entry) for entry in entries]
        return {"text": text, "output_ids": choice.token_ids, "meta_info": meta}

    def triple(self, logprob: float | None, token_id: int) -> list:
        return [logprob, token_id, self.names(token_id) if self.text_in_logprobs else None]

    def top(self, entry: TokenLogprob) -> list[list] | None:
        return [self.triple(logprob, alt) for alt, logprob in entry.top[: self.num_top]] if self.num_top else None

    @staticmethod
    def finish_reason(choice: ChoiceState) -> dict | None:
        """SGLang's: what ended the output, and the stop string or token it matched."""
        if choice.finish_reason is None:
            return None
        if choice.finish_reason == "length":
            return {"type": "length", "length": choice.num_tokens}
        if choice.finish_reason == "stop":
            matched = choice.stop_reason
            if matched is None and choice.token_ids:
                matched = choice.token_ids[-1]  # EOS
            return {"type": "stop", "matched": matched}
        return {"type": "abort", "message": choice.finish_reason}


def model_info(model_dir, max_model_len: int) -> dict:
    """SGLang's /get_model_info."""
    return {"model_path": str(model_dir), "tokenizer_path": str(model_dir), "is_generation": True, "max_model_len": max_model_len}
