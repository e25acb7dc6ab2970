"""The on-device sampler: one token per row, without syncing the host."""

from __future__ import annotations

from typing import Callable

import torch

from graphrt.kernels import argmax
from graphrt.runtime.logits_plan import LogitsPlan
from graphrt.runtime.logits_processors import TokenHistory, process_logits
from graphrt.runtime.transfers import host_to_device
from graphrt.sampling_params import SamplingParams


class Sampler:
    """Picks one token per row on the logits' device, without syncing the host.

    Random rows use the exponential race (argmax of p / q with q ~ Exp(1)), which draws exactly
    from p; a row with a seed draws from its own generator, so its tokens do not depend on which
    other requests share the batch.

    A micro-batch whose requests ask for penalties, bias, masks or min_p comes with a `LogitsPlan`,
    applied to its logits first (graphrt.runtime.logits_processors); the tokens sampled then go into
    the token history the sampler keeps for those requests. Without one nothing of it runs.
    """

    def __init__(self, device: torch.device, seed: int, greedy_argmax: Callable[[torch.Tensor], torch.Tensor] = argmax.greedy_argmax):
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.greedy_argmax = greedy_argmax  # the torch reference, or on a CPU the compiled twin where it is faster
        self.history = TokenHistory(device)

    def release(self, request_ids: list[int]) -> None:
        """Requests that ended: their token histories go."""
        self.history.release(request_ids)

    def request_generator(self, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        return torch.Generator(device=self.device).manual_seed(seed)

    def __call__(
        self,
        logits: torch.Tensor,  # (batch, vocab)
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        plan: LogitsPlan | None = None,
    ) -> torch.Tensor:
        if plan is None:
            return self._sample(logits, params, generators)
        processed = process_logits(logits, plan, self.history)
        token_ids = self._sample(processed.logits, params, generators, processed.min_p)
        processed.commit(token_ids)
        return token_ids

    def _sample(
        self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
        min_p: torch.Tensor | None = None,  # (batch,): drop tokens less likely than min_p times the most likely
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
        if min_p is not None:  # as vLLM: after the temperature, before top-k and top-p
            probs = probs.masked_fill(probs < min_p.float()[:, None] * probs.amax(dim=-1, keepdim=True), 0.0)
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
