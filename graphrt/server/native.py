"""SGLang's native API, for the scripts and clients written against it: POST /generate in its
request and response shapes (streamed as SGLang streams: each event the whole output so far),
GET /health_generate, /get_model_info and /get_server_info.

A /generate request is read as the completions request it amounts to (`completion_request`), so its
checks, sampling and engine path are completions'; only the names differ, and an error names the
parameter as this request sent it (`in_native_terms`).
"""

from __future__ import annotations

import re
import uuid
from contextlib import contextmanager
from typing import Any, Iterator

from pydantic import ValidationError

from graphrt.frontend.async_engine import GenerationJob
from graphrt.sampling_params import TokenLogprob
from graphrt.server.errors import APIError
from graphrt.server.protocol import CompletionRequest
from graphrt.server.responses import ChoiceState, ResponseFormat, TokenNames
from graphrt.server.validation import RENAMED, validation_error

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's
# The request's own fields beside text / input_ids and sampling_params.
REQUEST_FIELDS = ("stream", "return_logprob", "top_logprobs_num", "logprob_start_len", "return_text_in_logprobs", "rid")
NO_OPTIONS = dict.fromkeys(REQUEST_FIELDS)
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


@contextmanager
def in_native_terms(prompt_field: str) -> Iterator[None]:
    """An APIError raised within, as completions raises it, naming what a /generate request sent:
    `sampling_params.max_new_tokens` for `max_tokens`, `text` (or `input_ids`) for `prompt`..."""
    try:
        yield
    except APIError as exc:
        raise APIError(exc.status, _renamed(exc.message, prompt_field), param=exc.param and _renamed(exc.param, prompt_field), code=exc.code) from None


def _renamed(text: str, prompt_field: str) -> str:
    for pattern, replacement in _NATIVE_NAMES:
        text = pattern.sub(replacement, text)
    return re.sub(r"\bprompt\b", prompt_field, text)


_NATIVE_NAMES = [
    *((re.compile(rf"\b{ours}\b"), f"sampling_params.{theirs}") for theirs, ours in SAMPLING_NAMES.items()),
    (re.compile(r"\bstructured_outputs\.grammar\b"), "sampling_params.ebnf"),
    (re.compile(r"\bstructured_outputs\.json\b"), "sampling_params.json_schema"),
    (re.compile(r"\bstructured_outputs\.regex\b"), "sampling_params.regex"),
    (re.compile(r"\bprompt_logprobs\b"), "logprob_start_len"),
    (re.compile(r"\blogprobs\b"), "top_logprobs_num"),
    *((re.compile(rf"(?<![.\w]){name}\b"), f"sampling_params.{name}") for name in SAMPLING_FIELDS if name not in SAMPLING_NAMES),
]


def completion_request(raw: dict) -> tuple[CompletionRequest, dict]:
    """`raw` (a /generate body) as a completions request, and the request's own options
    (REQUEST_FIELDS). Raises APIError(400) naming what is wrong, in the request's names."""
    unknown = sorted(set(raw) - {"text", "input_ids", "sampling_params", *REQUEST_FIELDS})
    if unknown:
        advice = f"; {UNSERVED.get(unknown[0]) or RENAMED[unknown[0]]}" if unknown[0] in {*UNSERVED, *RENAMED} else ""
        raise APIError(400, f"unrecognized request argument: {unknown[0]}{advice}", param=unknown[0])
    given = [name for name in ("text", "input_ids") if raw.get(name) is not None]
    if len(given) != 1:
        raise APIError(400, "give exactly one of text (a prompt, or a list of them) and input_ids (token ids, or a list of them)", param="text")
    sampling = raw.get("sampling_params") or {}
    if not isinstance(sampling, dict):
        raise APIError(400, "sampling_params must be one object, for every prompt (a list of them, one per prompt, is not served)",
                       param="sampling_params")
    for name in sampling:
        if name not in SAMPLING_FIELDS:
            raise APIError(400, f"sampling_params.{name} is not a sampling parameter served here; the served ones are "
                           f"{', '.join(SAMPLING_FIELDS)}", param=f"sampling_params.{name}")
    options = {name: raw.get(name) for name in REQUEST_FIELDS}
    prompt = raw[given[0]]
    options["batch"] = isinstance(prompt, list) and not all(isinstance(token, int) for token in prompt)  # texts, or lists of ids
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": DEFAULT_MAX_NEW_TOKENS, "stream": options["stream"]}
    body.update({SAMPLING_NAMES.get(name, name): value for name, value in sampling.items()})
    if options["return_logprob"]:
        body["logprobs"] = options["top_logprobs_num"] or 0
        start = options["logprob_start_len"]
        if isinstance(start, int) and not isinstance(start, bool) and start >= 0:
            body["prompt_logprobs"] = options["top_logprobs_num"] or 0
    with in_native_terms(given[0]):
        try:
            request = CompletionRequest.model_validate(body)
        except ValidationError as exc:
            raise validation_error(exc) from None
        request.check()
    for name, kind in (("return_logprob", bool), ("return_text_in_logprobs", bool), ("top_logprobs_num", int), ("logprob_start_len", int)):
        value = options[name]
        if value is not None and (type(value) is not kind):
            raise APIError(400, f"{name}: must be a{'n integer' if kind is int else ' boolean'}, got {value!r}", param=name)
    return request, options


class NativeFormat(ResponseFormat):
    """SGLang's /generate output: per choice `text`, `output_ids` and `meta_info` (its id, a
    finish_reason object, token counts, latency, and with return_logprob the logprobs as
    [logprob, token id, text or null] triples). One object for one prompt and n = 1, else a list."""

    def __init__(self, request: CompletionRequest, options: dict, names: TokenNames):
        super().__init__("", request.num_logprobs, names)
        self.batch = bool(options.get("batch")) or request.n > 1
        self.text_in_logprobs = bool(options["return_text_in_logprobs"])
        self.prompt_start = options["logprob_start_len"] if request.num_prompt_logprobs is not None else None
        rid = options["rid"]
        self.rids = rid if isinstance(rid, list) else None
        self.rid = rid if isinstance(rid, str) else None
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
