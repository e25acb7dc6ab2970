"""Sampling parameters and the on-device sampler."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from graphrt.kernels import argmax

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # top_k and seeds travel between stages as int64
# Below this, a temperature is read as 0 (greedy), the limit it approaches: float32 holds it only as
# a subnormal (on GPUs possibly flushed to 0), and logits / temperature overflows to inf or NaN.
MIN_TEMPERATURE = torch.finfo(torch.float32).tiny
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


def host_to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small per-row tensor on `device` without blocking the host: `torch.tensor(..., device=cuda)`
    copies synchronously, which would make the host wait for the whole pipeline."""
    tensor = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


class Sampler:
    """Picks one token per row on the logits' device, without syncing the host.

    Random rows use the exponential race (argmax of p / q with q ~ Exp(1)), which draws exactly
    from p; a row with a seed draws from its own generator, so its tokens do not depend on which
    other requests share the batch.
    """

    def __init__(self, device: torch.device, seed: int, greedy_argmax: Callable[[torch.Tensor], torch.Tensor] = argmax.greedy_argmax):
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.greedy_argmax = greedy_argmax  # the torch reference, or on a CPU the compiled twin where it is faster

    def request_generator(self, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        return torch.Generator(device=self.device).manual_seed(seed)

    def __call__(
        self,
        logits: torch.Tensor,  # (batch, vocab)
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> torch.Tensor:
        greedy_ids = self.greedy_argmax(logits)
        if all(p.greedy for p in params):
            return greedy_ids
        device = logits.device
        rows = lambda values, dtype=torch.float32: host_to_device(values, dtype, device)  # noqa: E731
        vocab_size = logits.shape[-1]
        temperature = rows([p.temperature if not p.greedy else 1.0 for p in params])
        # Shifted so each row's largest logit is 0: dividing by a small temperature then goes
        # towards -inf (probability 0), never to +inf, which would make the softmax NaN.
        shifted = logits.float() - logits.float().amax(dim=-1, keepdim=True)  # (batch, vocab)
        probs = torch.softmax(shifted / temperature[:, None], dim=-1)
        sorted_probs, sorted_ids = probs.sort(dim=-1, descending=True)
        top_p = rows([p.top_p for p in params])
        top_k = rows([min(p.top_k, vocab_size) or vocab_size for p in params], torch.int64)
        # As vLLM and transformers do: keep the top_k most likely tokens, then, of those, the
        # smallest prefix whose share of their mass reaches top_p; always the first token (a
        # top_p that float32 rounds to 0 would otherwise drop it too).
        rank = torch.arange(vocab_size, device=device)
        beyond_k = rank[None, :] >= top_k[:, None]
        top_k_probs = sorted_probs.masked_fill(beyond_k, 0.0)
        mass_before = (top_k_probs.cumsum(dim=-1) - top_k_probs) / top_k_probs.sum(dim=-1, keepdim=True)
        dropped = (beyond_k | (mass_before >= top_p[:, None])) & (rank[None, :] > 0)
        sorted_probs = sorted_probs.masked_fill(dropped, 0.0)
        race = torch.empty_like(sorted_probs).exponential_(1.0, generator=self.generator)
        for row, generator in enumerate(generators):
            if generator is not None:
                race[row].exponential_(1.0, generator=generator)
        choice = (sorted_probs / race).argmax(dim=-1, keepdim=True)
        sampled_ids = sorted_ids.gather(-1, choice).squeeze(-1)
        is_greedy = rows([p.greedy for p in params], torch.bool)
        return torch.where(is_greedy, greedy_ids, sampled_ids)
