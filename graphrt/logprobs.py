"""Log-probabilities, for the requests that ask for them and at no cost to those that don't.

A micro-batch with such requests carries a `LogprobPlan`, made on the host when it is launched:
which of its sampled rows report their token's logprob, and which extra rows of the last stage's
logits score prompt tokens (`echo` with `logprobs`: a prefill chunk's row at position p scores
the prompt token at p + 1). The last stage computes them on its device from the same logits the
sampler used, as `log_softmax` of the raw logits (before temperature, top-k and top-p, as vLLM
reports by default), and they come back to the host with the token ids.

A prompt token is scored once: a sequence recomputed after a preemption does not score its
prompt again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from graphrt.sampling import host_to_device

if TYPE_CHECKING:
    from graphrt.sequence import Sequence
    from graphrt.step import ScheduledStep


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the most likely tokens and their logprobs, most likely first


@dataclass
class LogprobPlan:
    """What one micro-batch computes (see the module docstring), and its results once read back."""

    sampled: list[int]  # indices into the step's sample rows whose token is scored
    prompt_rows: list[int]  # rows of the step's flat tokens whose logits score a prompt token
    prompt_targets: list[int]  # the prompt token each of those rows scores
    prompt_owners: list[tuple[Sequence, int]]  # (sequence, position of the scored token)
    num_top: int  # alternatives computed per row: the most any of them asks for
    values: torch.Tensor | None = field(default=None, repr=False)  # (rows, 1 + num_top) float32, on the host
    top_ids: torch.Tensor | None = field(default=None, repr=False)  # (rows, num_top) int64, on the host

    @property
    def num_rows(self) -> int:
        return len(self.sampled) + len(self.prompt_rows)

    def allocate(self, pin: bool) -> None:
        """The host buffers the last stage writes into (page-locked when it is a GPU)."""
        self.values = torch.empty(self.num_rows, 1 + self.num_top, dtype=torch.float32, pin_memory=pin)
        self.top_ids = torch.empty(self.num_rows, self.num_top, dtype=torch.int64, pin_memory=pin)

    def apply(self, step: ScheduledStep, updated: list[Sequence]) -> None:
        """Hand the read-back logprobs to their sequences: a sampled token's to a sequence that got
        that token (`updated`), a prompt token's to a sequence that has not scored it yet."""
        values, top_ids = self.values.tolist(), self.top_ids.tolist()
        got_token = {id(seq) for seq in updated}
        for row, index in enumerate(self.sampled):
            seq = step.sampled_seqs[index]
            if id(seq) in got_token:
                seq.logprobs.append(_entry(seq.output_ids[-1], values[row], top_ids[row], seq.params.logprobs))
        for row, ((seq, position), target) in enumerate(zip(self.prompt_owners, self.prompt_targets), start=len(self.sampled)):
            if len(seq.prompt_logprobs) == position:
                seq.prompt_logprobs.append(_entry(target, values[row], top_ids[row], seq.params.prompt_logprobs))


def _entry(token_id: int, values: list[float], top_ids: list[int], num_top: int) -> TokenLogprob:
    return TokenLogprob(token_id, values[0], tuple(zip(top_ids[:num_top], values[1 : 1 + num_top])))


def plan_logprobs(step: ScheduledStep) -> LogprobPlan | None:
    """The logprobs a step computes, or None when none of its requests asks (the common case)."""
    if not any(seq.params.logprobs is not None or seq.params.prompt_logprobs is not None for seq in step.seqs):
        return None
    sampled = [i for i, seq in enumerate(step.sampled_seqs) if seq.params.logprobs is not None]
    prompt_rows, targets, owners = [], [], []
    num_top = max((step.sampled_seqs[i].params.logprobs for i in sampled), default=0)
    offset = 0
    for seq, start, query_len in zip(step.seqs, step.starts, step.query_lens):
        if seq.params.prompt_logprobs is not None and step.is_prefill:
            # The row at position p scores the prompt token at p + 1, if that one is not scored yet.
            first = max(start, len(seq.prompt_logprobs) - 1)
            positions = range(first, min(start + query_len, seq.prompt_len - 1))
            for position in positions:
                prompt_rows.append(offset + position - start)
                targets.append(seq.prompt_ids[position + 1])
                owners.append((seq, position + 1))
            if positions:
                num_top = max(num_top, seq.params.prompt_logprobs)
        offset += query_len
    if not sampled and not prompt_rows:
        return None
    return LogprobPlan(sampled, prompt_rows, targets, owners, num_top)


def compute_logprobs(logits: torch.Tensor, targets: torch.Tensor, num_top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (rows, vocab), targets (rows,) int64, on one device -> the targets' logprobs and the
    `num_top` most likely tokens' as values (rows, 1 + num_top) float32 and ids (rows, num_top)."""
    # In float32 at least (float64 models in float64); reported in float32, as vLLM does.
    logprobs = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    chosen = logprobs.gather(-1, targets[:, None])
    top_values, top_ids = logprobs.topk(num_top, dim=-1)
    return torch.cat([chosen, top_values], dim=-1).float(), top_ids


def score_rows(
    logits: torch.Tensor, sampled_logits: torch.Tensor | None, sampled_tokens: torch.Tensor | None,
    sampled: list[int], num_rows: int, prompt_targets: list[int], num_top: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """On the last stage: score rows `sampled` of the sampled logits (their sampled tokens), then
    the prompt rows, which follow the `num_rows` last-token rows of the stage's `logits`."""
    device = logits.device
    rows, targets = [], []
    if sampled:
        index = host_to_device(sampled, torch.int64, device)
        rows.append(sampled_logits[index])
        targets.append(sampled_tokens[index])
    if prompt_targets:
        rows.append(logits[num_rows : num_rows + len(prompt_targets)])
        targets.append(host_to_device(prompt_targets, torch.int64, device))
    return compute_logprobs(torch.cat(rows), torch.cat(targets), num_top)
