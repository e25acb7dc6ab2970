"""What a request asks of sampling: how to pick each next token, and when to stop; and what it
reports of a token (`TokenLogprob`).

Plain data with no torch, so the scheduler (and the CLI) can hold it without loading torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # top_k and seeds travel between stages as int64
# Below this, a temperature is read as 0 (greedy), the limit it approaches: float32 holds it only as
# a subnormal (on GPUs possibly flushed to 0), and logits / temperature overflows to inf or NaN.
MIN_TEMPERATURE = 2.0**-126  # torch.finfo(torch.float32).tiny
MAX_LOGPROBS = 20  # most alternatives a request may ask for per token, as OpenAI allows


@dataclass
class SamplingParams:
    """How to pick each next token, and when to stop. temperature 0 is greedy."""

    max_tokens: int | None = 16  # None: up to the model's context length
    temperature: float = 1.0
    top_k: int = 0  # 0: no limit
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    # Log-probabilities from the model's raw logits (log_softmax before temperature, top-k and
    # top-p): None asks for none; k >= 0 gives each token's own and its k most likely alternatives.
    logprobs: int | None = None  # of each generated token
    prompt_logprobs: int | None = None  # of each prompt token after the first

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number >= 0 (0 is greedy), got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or not 0 <= self.top_k <= INT64_MAX:
            raise ValueError(f"top_k must be an integer in [0, {INT64_MAX}] (0 disables it), got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not INT64_MIN <= self.seed <= INT64_MAX):
            raise ValueError(f"seed must be an integer in [{INT64_MIN}, {INT64_MAX}], got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], got {value!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the most likely tokens and their logprobs, most likely first
