"""Log-probabilities, for the requests that ask for them and at no cost to those that don't.

A micro-batch with such requests carries a `LogprobPlan`, made on the host when it is launched:
which of its sampled entries (a verify row has one per token it verifies) report their token's logprob, and which extra rows of the last stage's
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

from graphrt.runtime.transfers import host_to_device
from graphrt.sampling_params import TokenLogprob

if TYPE_CHECKING:
    from graphrt.runtime.step import ScheduledStep


@dataclass
class LogprobPlan:
    """What one micro-batch computes (see the module docstring), and its results once read back."""

    sampled: list[int]  # the sample entries whose token is scored (a verify row has one per token it verifies)
    prompt_rows: list[int]  # rows of the step's flat tokens whose logits score a prompt token
    prompt_targets: list[int]  # the prompt token each of those rows scores
    prompt_owners: list[tuple[int, int]]  # (row of the step, position of the scored prompt token)
    num_top: int  # alternatives computed per row: the most any of them asks for
    sampled_top: list[int]  # alternatives each scored sampled token reports
    prompt_top: list[int]  # and each scored prompt token
    values: torch.Tensor | None = field(default=None, repr=False)  # (rows, 2 + num_top) float32, on the host
    top_ids: torch.Tensor | None = field(default=None, repr=False)  # (rows, num_top) int64, on the host

    @property
    def num_rows(self) -> int:
        return len(self.sampled) + len(self.prompt_rows)

    def allocate(self, pin: bool) -> None:
        """The host buffers the last stage writes into (page-locked when it is a GPU)."""
        self.values = torch.empty(self.num_rows, 2 + self.num_top, dtype=torch.float32, pin_memory=pin)
        self.top_ids = torch.empty(self.num_rows, self.num_top, dtype=torch.int64, pin_memory=pin)

    def read_back(self, token_ids: list[int] | None) -> StepLogprobs:
        """The logprobs read back, as entries for the scheduler to hand to their sequences;
        `token_ids`: the step's sampled tokens, one per sample entry (None: it sampled none)."""
        values, top_ids = self.values.tolist(), self.top_ids.tolist()
        sampled = {
            index: _entry(token_ids[index], values[row], top_ids[row], num_top)
            for row, (index, num_top) in enumerate(zip(self.sampled, self.sampled_top))
        } if token_ids is not None else {}
        first = len(self.sampled)
        prompt = [
            (seq_row, position, _entry(target, values[row], top_ids[row], num_top))
            for row, ((seq_row, position), target, num_top) in enumerate(
                zip(self.prompt_owners, self.prompt_targets, self.prompt_top), start=first
            )
        ]
        return StepLogprobs(sampled, prompt)


@dataclass
class StepLogprobs:
    """One micro-batch's logprobs, read back: what `Scheduler.update_from_output` appends."""

    sampled: dict[int, TokenLogprob]  # sample entry -> the logprob of the token sampled there
    prompt: list[tuple[int, int, TokenLogprob]]  # (row of the step, position of the prompt token, its logprob)


def _entry(token_id: int, values: list[float], top_ids: list[int], num_top: int) -> TokenLogprob:
    return TokenLogprob(token_id, values[0], tuple(zip(top_ids[:num_top], values[2 : 2 + num_top])), rank=int(values[1]))


def plan_logprobs(step: ScheduledStep) -> LogprobPlan | None:
    """The logprobs a step computes, or None when none of its requests asks (the common case)."""
    if not any(seq.params.logprobs is not None or seq.params.prompt_logprobs is not None for seq in step.seqs):
        return None
    # Every entry of a verify row: which of its tokens are kept is known only once they are back.
    sampled, sampled_top, entry = [], [], 0
    for seq, count in zip(step.sampled_seqs, step.sample_counts):
        if seq.params.logprobs is not None:
            sampled += range(entry, entry + count)
            sampled_top += [seq.params.logprobs] * count
        entry += count
    prompt_rows, targets, owners, prompt_top = [], [], [], []
    num_top = max(sampled_top, default=0)
    offset = 0
    for seq_row, (seq, start, query_len) in enumerate(zip(step.seqs, step.starts, step.query_lens)):
        if seq.params.prompt_logprobs is not None and step.is_prefill:
            # The row at position p scores the prompt token at p + 1, if that one is not scored yet.
            first = max(start, len(seq.prompt_logprobs) - 1)
            positions = range(first, min(start + query_len, seq.prompt_len - 1))
            for position in positions:
                prompt_rows.append(offset + position - start)
                targets.append(seq.prompt_ids[position + 1])
                owners.append((seq_row, position + 1))
                prompt_top.append(seq.params.prompt_logprobs)
            if positions:
                num_top = max(num_top, seq.params.prompt_logprobs)
        offset += query_len
    if not sampled and not prompt_rows:
        return None
    return LogprobPlan(sampled, prompt_rows, targets, owners, num_top, sampled_top, prompt_top)


def compute_logprobs(logits: torch.Tensor, targets: torch.Tensor, num_top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (rows, vocab), targets (rows,) int64, on one device -> values (rows, 2 + num_top)
    float32: each target's logprob, its rank (the tokens at least as likely, itself included, as vLLM counts),
    then the `num_top` most likely tokens' logprobs; and their ids (rows, num_top)."""
    # In float32 at least (float64 models in float64); reported in float32, as vLLM does.
    logprobs = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    chosen = logprobs.gather(-1, targets[:, None])
    rank = (logprobs >= chosen).sum(dim=-1, keepdim=True)  # tied tokens count as more likely; exact in float32 below 2^24
    top_values, top_ids = logprobs.topk(num_top, dim=-1)
    return torch.cat([chosen, rank.to(chosen.dtype), top_values], dim=-1).float(), top_ids


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
