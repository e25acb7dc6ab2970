"""What a request asks of sampling: how to pick each next token, and when to stop; and what it
reports of a token (`TokenLogprob`).

Plain data with no torch, so the scheduler (and the CLI) can hold it without loading torch.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # top_k and seeds travel between stages as int64
# Below this, a temperature is read as 0 (greedy), the limit it approaches: float32 holds it only as
# a subnormal (on GPUs possibly flushed to 0), and logits / temperature overflows to inf or NaN.
MIN_TEMPERATURE = 2.0**-126  # torch.finfo(torch.float32).tiny
MAX_LOGPROBS = 20  # most alternatives a request may ask for per token, as OpenAI allows
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-MAX_PENALTY, MAX_PENALTY], as OpenAI allows
MAX_LOGIT_BIAS = 100.0  # a logit bias lies in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS], as OpenAI allows
MAX_BAD_WORDS = 128  # bad words per request, tokenized (each word counts once per way it tokenizes)
MAX_N = 128  # outputs per prompt (n); the server allows as many sequences per request in all


@dataclass
class StructuredOutput:
    """What a request's output must match, as vLLM's `StructuredOutputsParams` says it: exactly one
    of a JSON schema, any JSON object, a regular expression, a choice of strings, or an EBNF grammar
    (xgrammar's dialect, GBNF-like). The engine compiles it into a token mask (graphrt.engine.grammar).
    """

    json: str | None = None  # a JSON schema, as JSON text (a dict given here is written as text)
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: list[str] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # EBNF, with a `root` rule

    def __post_init__(self) -> None:
        if isinstance(self.json, (dict, bool)):
            self.json = json.dumps(self.json)  # in its order: properties are generated in the order given
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(
                "structured_output takes exactly one of json, json_object, regex, choice, grammar; "
                + (f"got {', '.join(given)}" if given else "got none")
            )
        for name in ("json", "regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"structured_output.{name} must be a non-empty string, got {value!r}")
        if self.choice is not None and (
            not isinstance(self.choice, list) or not self.choice or any(not isinstance(c, str) or not c for c in self.choice)
        ):
            raise ValueError(f"structured_output.choice must be a non-empty list of non-empty strings, got {self.choice!r}")

    @property
    def kind(self) -> str:
        """Which one it is: json, json_object, regex, choice or grammar."""
        if self.json_object:
            return "json_object"
        return next(name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None)

    def key(self) -> tuple[str, str]:
        """What a compiled grammar is cached by."""
        kind = self.kind
        value = {"json_object": "", "choice": "\x00".join(self.choice or ())}.get(kind, getattr(self, kind))
        return kind, value


@dataclass
class SamplingParams:
    """How to pick each next token, and when to stop. temperature 0 is greedy. As in vLLM, `n`
    outputs per prompt (`LLM.generate`; output i samples with `seed + i`), `top_k` -1 means no
    limit, and None for a list means an empty one."""

    n: int = 1  # outputs per prompt
    max_tokens: int | None = 16  # None: up to the model's context length
    temperature: float = 1.0
    top_k: int = 0  # 0: no limit
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False  # vLLM's: the text ends after the stop string, not before it
    ignore_eos: bool = False
    # The text leaves out the tokenizer's special tokens, as vLLM's does by default; False keeps them
    # (a tool-call parser whose markers are special tokens reads them there: the server asks so). The
    # stop token that ends a request (EOS, or one of stop_token_ids) is not part of the text either way.
    skip_special_tokens: bool = True
    # Log-probabilities from the model's raw logits (log_softmax before penalties, bias, temperature,
    # top-k and top-p, vLLM's default): None asks for none; k >= 0 gives each token's own and its k
    # most likely alternatives.
    logprobs: int | None = None  # of each generated token
    prompt_logprobs: int | None = None  # of each prompt token after the first
    # What is done to the logits before the temperature, in vLLM's order (graphrt.runtime.logits_processors);
    # every default leaves them as they are. Penalties count the request's tokens so far: OpenAI's
    # presence and frequency penalties subtract `presence_penalty` from the logit of every token that
    # has been output and `frequency_penalty` times how often; the repetition penalty (transformers,
    # vLLM) divides a positive logit of a token in the prompt or the output by `repetition_penalty`
    # and multiplies a negative one.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0  # after the temperature: drop tokens less likely than min_p times the most likely
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens are out
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    stop_token_ids: list[int] = field(default_factory=list)  # end the request (finish reason "stop"), as EOS does
    # A word (a token sequence) is banned: its last token is masked where the tokens before it were
    # just output (a one-token word always). `bad_words` are texts, which the front tokenizes into
    # `bad_words_token_ids` as vLLM does (the word alone and after a space); the engine reads the ids.
    bad_words: list[str] = field(default_factory=list)
    bad_words_token_ids: list[list[int]] | None = None
    allowed_token_ids: list[int] | None = None  # only these tokens may be sampled
    # The output must match a grammar (graphrt.engine.grammar); a dict is read as StructuredOutput's fields.
    structured_output: StructuredOutput | None = None

    def __post_init__(self) -> None:
        for name in ("stop", "bad_words", "stop_token_ids"):  # as vLLM: one string, a tuple or None are fine
            value = getattr(self, name)
            if value is None:
                setattr(self, name, [])
            elif isinstance(value, str) and name != "stop_token_ids":
                setattr(self, name, [value])
            elif isinstance(value, tuple):
                setattr(self, name, list(value))
        if self.top_k == -1:
            self.top_k = 0  # vLLM's "no limit"
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be a positive integer (or None: up to the context), got {self.max_tokens!r}")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 is greedy), got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or not 0 <= self.top_k <= INT64_MAX:
            raise ValueError(f"top_k must be an integer in [0, {INT64_MAX}] (0 or -1 disables it), got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or not INT64_MIN <= self.seed <= INT64_MAX - (self.n - 1)):
            raise ValueError(f"seed must be an integer in [{INT64_MIN}, {INT64_MAX - (self.n - 1)}], got {self.seed!r}")
        if not isinstance(self.stop, list) or any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a string or a list of non-empty strings, got {self.stop!r}")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], got {value!r}")
        self._check_logit_processing()
        if isinstance(self.structured_output, dict):
            self.structured_output = StructuredOutput(**self.structured_output)
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutput):
            raise ValueError(f"structured_output must be a StructuredOutput (or a dict of its fields), got {self.structured_output!r}")
        if self.structured_output is not None and self.min_tokens:
            # The grammar may allow only EOS before min_tokens, which would leave no token to sample.
            raise ValueError("min_tokens cannot be combined with structured_output: the grammar decides where the output ends")
        # Read for every sampled row of every micro-batch, so worked out once (params are not changed after).
        self.uses_penalties = self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
        self.bad_word_prefix_len = max((len(word) - 1 for word in self.bad_words_token_ids or ()), default=0)
        # A token history on the sampler's device: counts for penalties, recent tokens for bad words.
        self.tracks_history = self.uses_penalties or self.bad_word_prefix_len > 0
        self.processes_logits = bool(
            self.tracks_history or self.min_p or self.min_tokens or self.logit_bias or self.bad_words_token_ids
            or self.allowed_token_ids is not None or self.structured_output is not None
        )

    def _check_logit_processing(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise ValueError(f"{name} must be a number in [{-MAX_PENALTY:g}, {MAX_PENALTY:g}] (0 is off), got {value!r}")
        if not _is_number(self.repetition_penalty) or not (0 < self.repetition_penalty < math.inf):
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1 is off), got {self.repetition_penalty!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be a number in [0, 1] (0 is off), got {self.min_p!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}")
            for token, bias in self.logit_bias.items():
                _check_token_id("logit_bias", token, "a key")
                if not _is_number(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                    raise ValueError(
                        f"logit_bias[{token}] must be a number in [{-MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias!r}"
                    )
        for name in ("stop_token_ids", "allowed_token_ids"):
            ids = getattr(self, name)
            if ids is None and name == "allowed_token_ids":
                continue
            if not isinstance(ids, list) or (name == "allowed_token_ids" and not ids):
                what = "a non-empty list" if name == "allowed_token_ids" else "a list"
                raise ValueError(f"{name} must be {what} of token ids, got {ids!r}")
            for token in ids:
                _check_token_id(name, token, "an element")
        if not isinstance(self.bad_words, list) or any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            raise ValueError(f"bad_words must be a list of words (non-blank strings), got {self.bad_words!r}")
        if len(self.bad_words) > MAX_BAD_WORDS:
            raise ValueError(f"bad_words holds {len(self.bad_words)} words; at most {MAX_BAD_WORDS}")
        if self.bad_words_token_ids is not None:
            words = self.bad_words_token_ids
            if not isinstance(words, list) or any(not isinstance(w, list) or not w for w in words):
                raise ValueError(f"bad_words_token_ids must be a list of non-empty lists of token ids, got {words!r}")
            if len(words) > 2 * MAX_BAD_WORDS:
                raise ValueError(f"bad_words_token_ids holds {len(words)} words; at most {2 * MAX_BAD_WORDS}")
            for word in words:
                for token in word:
                    _check_token_id("bad_words_token_ids", token, "a token")

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    def token_ids_named(self) -> list[tuple[str, int]]:
        """Every token id the request names, with the parameter naming it: the engine checks them
        against the model's vocabulary."""
        named = [("logit_bias", t) for t in self.logit_bias or ()] + [("stop_token_ids", t) for t in self.stop_token_ids]
        named += [("allowed_token_ids", t) for t in self.allowed_token_ids or ()]
        named += [("bad_words", t) for word in self.bad_words_token_ids or () for t in word]
        return named


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_token_id(name: str, token, what: str) -> None:
    if not _is_int(token) or not 0 <= token <= INT64_MAX:
        raise ValueError(f"{name}: {what} is {token!r}, which is not a token id (an integer >= 0)")


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the most likely tokens and their logprobs, most likely first
    rank: int | None = None  # vLLM's: how many tokens are at least as likely as this one, itself included
