"""A `LogitsPlan` applied on the sampler's device (what it holds: graphrt.runtime.logits_plan), and
the token history it reads, kept there.

In vLLM's order: the grammar's mask (structured output), allowed tokens, bad words, min_tokens and one-token bad words, logit_bias, then the
repetition, frequency and presence penalties; `min_p` comes later, after the temperature (the
sampler). Everything is a handful of batched tensor ops over the rows that ask, with no host sync,
so a plan never stalls the ring.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphrt.runtime.logits_plan import ANY_TOKEN, NO_TOKEN, LogitsPlan
from graphrt.runtime.transfers import host_to_device


class TokenHistory:
    """Per request, on one device: how often each token has been output (`counts`), which tokens
    its prompt holds (`in_prompt`, for the repetition penalty) and its last output tokens
    (`recent`, for bad words; NO_TOKEN before the first). One row each, from a pool that grows
    as requests need rows and takes back those of ended requests (`release`)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.rows: dict[int, int] = {}  # request id -> its row
        self.free: list[int] = []
        self.counts: torch.Tensor | None = None  # (capacity, vocab) int32
        self.in_prompt: torch.Tensor | None = None  # (capacity, vocab) bool
        self.recent: torch.Tensor | None = None  # (capacity, width) int64
        self.width = 0

    def rows_of(self, request_ids: list[int]) -> list[int]:
        return [self.rows[request_id] for request_id in request_ids]

    def take_rows(self, request_ids: list[int], vocab_size: int) -> list[int]:
        """Rows for requests whose history starts (again) here: their own, or new ones."""
        missing = [request_id for request_id in request_ids if request_id not in self.rows]
        if len(missing) > len(self.free):
            self._grow(len(self.rows) + len(missing), vocab_size)
        for request_id in missing:
            self.rows[request_id] = self.free.pop()
        return self.rows_of(request_ids)

    def widen(self, width: int) -> None:
        """Keep at least `width` recent tokens per request (the older ones are not known: NO_TOKEN)."""
        if width <= self.width:
            return
        if self.recent is not None:
            pad = torch.full((self.recent.shape[0], width - self.width), NO_TOKEN, dtype=torch.int64, device=self.device)
            self.recent = torch.cat([pad, self.recent], dim=1)
        self.width = width

    def release(self, request_ids: list[int]) -> None:
        for request_id in request_ids:
            row = self.rows.pop(request_id, None)
            if row is not None:
                self.free.append(row)

    def _grow(self, needed: int, vocab_size: int) -> None:
        old = 0 if self.counts is None else self.counts.shape[0]
        capacity = max(needed, 2 * old, 8)
        counts = torch.zeros(capacity, vocab_size, dtype=torch.int32, device=self.device)
        in_prompt = torch.zeros(capacity, vocab_size, dtype=torch.bool, device=self.device)
        recent = torch.full((capacity, self.width), NO_TOKEN, dtype=torch.int64, device=self.device)
        if old:
            counts[:old], in_prompt[:old], recent[:old] = self.counts, self.in_prompt, self.recent
        self.counts, self.in_prompt, self.recent = counts, in_prompt, recent
        self.free = list(range(capacity - 1, old - 1, -1)) + self.free


@dataclass
class Processed:
    """A micro-batch's logits after its plan, and what `commit` needs to add its sampled tokens
    to the token history."""

    logits: torch.Tensor  # (entries, vocab), in float32 at least
    min_p: torch.Tensor | None  # (entries,) in the logits' dtype, or None
    history: TokenHistory
    tensors: dict[str, torch.Tensor]  # the plan's lists, and the history rows, on the device
    num_priors: int
    groups: list[tuple[int, int]]  # per request with history entries: (its first history index, how many)

    def commit(self, token_ids: torch.Tensor) -> None:
        """Count the sampled tokens (entries,) into their requests' histories: each history entry
        whose drafts before it were all accepted (every entry not of a verify row)."""
        t, history = self.tensors, self.history
        if not self.groups:
            return
        tokens = token_ids[t["history_entries"]]  # (history entries,)
        kept = torch.ones_like(tokens, dtype=torch.int32)
        if self.num_priors:
            missed = (token_ids[t["prior_samples"]] != t["prior_tokens"]).int()
            kept = (torch.zeros_like(kept).index_add_(0, t["prior_history"], missed) == 0).int()
        history.counts.index_put_((t["history_rows"], tokens), kept, accumulate=True)
        if history.width:
            self._shift_recent(tokens, kept)

    def _shift_recent(self, tokens: torch.Tensor, kept: torch.Tensor) -> None:
        """Each request's recent tokens move left by the tokens it kept (a verify row's run)."""
        t, history, width = self.tensors, self.history, self.history.width
        most = max(count for _, count in self.groups)
        firsts = t["group_firsts"]  # (requests,)
        spread = (firsts[:, None] + torch.arange(most, device=tokens.device)).clamp(max=tokens.shape[0] - 1)
        extended = torch.cat([history.recent[t["group_rows"]], tokens[spread]], dim=1)  # (requests, width + most)
        num_kept = torch.zeros(len(self.groups), dtype=torch.int64, device=tokens.device).index_add_(
            0, t["group_of_history"], kept.long()
        )
        history.recent[t["group_rows"]] = extended.gather(1, num_kept[:, None] + torch.arange(width, device=tokens.device))


_INT_LISTS = (
    "history_entries", "prior_history", "prior_columns", "prior_tokens", "prior_samples", "init_prompt_owners",
    "init_prompt_tokens", "init_output_owners", "init_output_tokens", "init_recent", "word_history", "word_last",
    "word_prefixes", "banned_entries", "banned_tokens", "allowed_entries", "allowed_rows", "allowed_tokens",
    "bias_entries", "bias_tokens", "history_priors", "grammar_entries", "grammar_masks",
)
_FLOAT_LISTS = ("presence", "frequency", "repetition", "bias_values", "min_p")


def process_logits(logits: torch.Tensor, plan: LogitsPlan, history: TokenHistory) -> Processed:
    """The micro-batch's logits (entries, vocab) after `plan`, in a new tensor of at least float32."""
    device, vocab_size = logits.device, logits.shape[-1]
    x = logits.to(torch.promote_types(logits.dtype, torch.float32), copy=True)
    history.widen(plan.window)
    init_rows = history.take_rows(plan.init_requests, vocab_size) if plan.init_requests else []
    groups, group_of_history = _groups(plan.history_requests)
    history_rows = history.rows_of(plan.history_requests)
    extra = {
        "init_rows": init_rows, "history_rows": history_rows, "group_of_history": group_of_history,
        "group_firsts": [first for first, _ in groups], "group_rows": [history_rows[first] for first, _ in groups],
    }
    ints = {**{name: getattr(plan, name) for name in _INT_LISTS}, **extra}
    t = _on_device(ints, {name: getattr(plan, name) for name in _FLOAT_LISTS}, device)
    if init_rows:
        _start_histories(plan, t, history)
    num_priors = len(plan.prior_tokens)
    if plan.grammar_entries:
        _mask_by_grammar(x, t, every_entry=plan.grammar_entries == list(range(x.shape[0])))
    if plan.allowed_entries:
        allowed = torch.zeros(len(plan.allowed_entries), vocab_size, dtype=torch.bool, device=device)
        allowed.index_put_((t["allowed_rows"], t["allowed_tokens"]), torch.ones_like(t["allowed_tokens"], dtype=torch.bool))
        x[t["allowed_entries"]] = x[t["allowed_entries"]].masked_fill(~allowed, -torch.inf)
    if plan.word_history:
        _ban_bad_words(x, plan, t, history, num_priors)
    if plan.banned_entries:
        x.index_put_((t["banned_entries"], t["banned_tokens"]), torch.full_like(t["banned_tokens"], -torch.inf, dtype=x.dtype))
    if plan.bias_entries:
        x.index_put_((t["bias_entries"], t["bias_tokens"]), t["bias_values"].to(x.dtype), accumulate=True)
    if plan.presence:
        _apply_penalties(x, plan, t, history, num_priors)
    min_p = t["min_p"].to(x.dtype) if plan.min_p else None
    return Processed(x, min_p, history, t, num_priors, groups)


def _mask_by_grammar(x: torch.Tensor, t: dict[str, torch.Tensor], every_entry: bool) -> None:
    """-inf for every token an entry's grammar refuses: those whose bit (t % 32 of word t // 32) is 0.
    `every_entry`: the entries are all of x's rows, in order (no gather and scatter back)."""
    entries = t["grammar_entries"]
    words = t["grammar_masks"].view(entries.shape[0], -1).to(torch.int32)  # xgrammar's words, exact in int32
    bits = torch.arange(32, dtype=torch.int32, device=x.device)
    refused = ((words[:, :, None] >> bits) & 1).view(entries.shape[0], -1)[:, : x.shape[-1]] == 0
    if every_entry:
        x.masked_fill_(refused, -torch.inf)
    else:
        x[entries] = x[entries].masked_fill(refused, -torch.inf)


def _start_histories(plan: LogitsPlan, t: dict[str, torch.Tensor], history: TokenHistory) -> None:
    """Counts from the output so far, the prompt's tokens, the last output tokens: all known on the host."""
    # No `tensor[index] = scalar` here: on CUDA that copies the scalar from the host, which waits
    # for the device (torch 2.11 on an H200); index_fill_ and a device tensor of values do not.
    rows = t["init_rows"]
    history.counts.index_fill_(0, rows, 0)
    history.in_prompt.index_fill_(0, rows, False)
    if plan.init_output_tokens:
        ones = torch.ones(len(plan.init_output_tokens), dtype=torch.int32, device=rows.device)
        history.counts.index_put_((rows[t["init_output_owners"]], t["init_output_tokens"]), ones, accumulate=True)
    if plan.init_prompt_tokens:
        prompt_tokens = t["init_prompt_tokens"]
        history.in_prompt.index_put_((rows[t["init_prompt_owners"]], prompt_tokens), torch.ones_like(prompt_tokens, dtype=torch.bool))
    if history.width:
        recent = torch.full((len(plan.init_requests), history.width), NO_TOKEN, dtype=torch.int64, device=rows.device)
        if plan.window:
            recent[:, -plan.window :] = t["init_recent"].view(len(plan.init_requests), plan.window)
        history.recent[rows] = recent


def _ban_bad_words(x: torch.Tensor, plan: LogitsPlan, t: dict[str, torch.Tensor], history: TokenHistory, num_priors: int) -> None:
    """Mask a word's last token at each entry whose last output tokens (its drafts before it
    included) are the word's prefix."""
    width, window = history.width, plan.window
    recent = history.recent[t["history_rows"]]  # (history entries, width)
    if num_priors:
        most = max(plan.history_priors)
        drafts = torch.full((recent.shape[0], most), NO_TOKEN, dtype=torch.int64, device=x.device)
        drafts[t["prior_history"], t["prior_columns"]] = t["prior_tokens"]
        columns = t["history_priors"][:, None] + torch.arange(width - window, width, device=x.device)
        before = torch.cat([recent, drafts], dim=1).gather(1, columns)  # (history entries, window)
    else:
        before = recent[:, width - window :]
    prefixes = t["word_prefixes"].view(-1, window)
    matched = ((before[t["word_history"]] == prefixes) | (prefixes == ANY_TOKEN)).all(dim=-1)
    # Added rather than written: two words of an entry may end in the same token, one matched, one not.
    ban = torch.where(matched, -torch.inf, 0.0).to(x.dtype)
    x.index_put_((t["history_entries"][t["word_history"]], t["word_last"]), ban, accumulate=True)


def _apply_penalties(
    x: torch.Tensor, plan: LogitsPlan, t: dict[str, torch.Tensor], history: TokenHistory, num_priors: int
) -> None:
    """Dense over (history entries, vocab), as vLLM's; a penalty no entry uses costs no pass."""
    every_entry = plan.history_entries == list(range(x.shape[0]))  # then no gather and scatter back
    entries = t["history_entries"]
    counts = history.counts[t["history_rows"]]  # (history entries, vocab) int32
    if num_priors:
        ones = torch.ones(num_priors, dtype=torch.int32, device=x.device)
        counts.index_put_((t["prior_history"], t["prior_tokens"]), ones, accumulate=True)
    output = counts > 0
    logits = x if every_entry else x[entries]
    if any(p != 1 for p in plan.repetition):
        penalty = t["repetition"].to(x.dtype)[:, None]
        seen = output | history.in_prompt[t["history_rows"]]
        logits = torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)
    # The products promote the counts and the mask to the logits' dtype in the same pass.
    if any(plan.frequency):
        logits.sub_(t["frequency"].to(x.dtype)[:, None] * counts)
    if any(plan.presence):
        logits.sub_(t["presence"].to(x.dtype)[:, None] * output)
    if logits is x:
        return
    if every_entry:
        x.copy_(logits)
    else:
        x[entries] = logits


def _groups(request_ids: list[int]) -> tuple[list[tuple[int, int]], list[int]]:
    """Runs of one request among the history entries: (first index, length) each, and each entry's run."""
    groups, owner = [], []
    for index, request_id in enumerate(request_ids):
        if not groups or request_ids[groups[-1][0]] != request_id:
            groups.append([index, 0])
        groups[-1][1] += 1
        owner.append(len(groups) - 1)
    return [tuple(g) for g in groups], owner


def _on_device(ints: dict[str, list[int]], floats: dict[str, list[float]], device: torch.device) -> dict[str, torch.Tensor]:
    """Every list as a view of one int64 and one float64 tensor, each copied to `device` once."""
    out = {}
    for named, dtype in ((ints, torch.int64), (floats, torch.float64)):
        flat = host_to_device([v for values in named.values() for v in values], dtype, device)
        for name, part in zip(named, flat.split([len(values) for values in named.values()])):
            out[name] = part
    return out
