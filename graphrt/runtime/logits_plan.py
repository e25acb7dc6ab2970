"""What the last stage does to a micro-batch's logits before sampling, for the requests that ask:
a grammar's mask (structured output, graphrt.engine.grammar), penalties, `min_p`, `min_tokens`,
`logit_bias`, bad words and allowed tokens (graphrt.sampling_params).

A micro-batch with such requests carries a `LogitsPlan`, made on the host when it is launched, as
plain lists: they travel to a stage process as they are (graphrt.distributed.transport), and the
sampler applies them on its device (graphrt.runtime.logits_processors). None of this is made for a
micro-batch whose requests all keep the defaults, the common case.

The plan names the micro-batch's sampled tokens as entries, in order (a verify row has 1 + d of
them, each sampled after the drafts before it). Whatever needs a request's past output (penalties,
bad words longer than one token) reads its token history, which the sampler keeps on its device
and updates from the tokens it samples, so the next step of a request may be launched before its
tokens reach the host (async scheduling). Where the history starts, the host knows every token: a
request's history starts (again) at the step that ends its prefill, which after a preemption
prefills every token it has. A verify row's entry j also counts the j drafts before it, and the
history keeps of a verify row only the tokens its drafts accept, which the device works out as the
host does (graphrt.engine.speculation.accept_drafts): an entry counts once every draft before it
equals the token sampled in its place.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from graphrt.runtime.step import ScheduledStep

ANY_TOKEN = -2  # a bad word's prefix is right-aligned in the window; columns before it match anything
NO_TOKEN = -1  # a history's window before the request's first output token


@dataclass
class LogitsPlan:
    """One micro-batch's logit processing (see the module docstring). Entries index its sampled
    tokens; a history entry reads its request's token history."""

    window: int = 0  # output tokens before an entry that bad words compare: their longest prefix here
    # The entries that read a request's history, with the request, and how many drafts before them
    # (a verify row's entry j: j) are not in the history yet. A request's entries are consecutive.
    history_entries: list[int] = field(default_factory=list)
    history_requests: list[int] = field(default_factory=list)
    history_priors: list[int] = field(default_factory=list)
    # Requests whose history starts (again) here: their prompt tokens (only with a repetition
    # penalty) and output tokens, each with its request's index in init_requests, and their last
    # `window` output tokens (NO_TOKEN before the first).
    init_requests: list[int] = field(default_factory=list)
    init_prompt_owners: list[int] = field(default_factory=list)
    init_prompt_tokens: list[int] = field(default_factory=list)
    init_output_owners: list[int] = field(default_factory=list)
    init_output_tokens: list[int] = field(default_factory=list)
    init_recent: list[int] = field(default_factory=list)
    # A verify row's drafts before each of its entries: (history index of the entry, the draft's
    # place among them, the draft, the entry whose sampled token must equal it for the entry to count).
    prior_history: list[int] = field(default_factory=list)
    prior_columns: list[int] = field(default_factory=list)
    prior_tokens: list[int] = field(default_factory=list)
    prior_samples: list[int] = field(default_factory=list)
    # Penalties per history entry; [] when no request here has one.
    presence: list[float] = field(default_factory=list)
    frequency: list[float] = field(default_factory=list)
    repetition: list[float] = field(default_factory=list)
    # Bad words longer than one token: the history entry, the word's last token, its prefix
    # right-aligned in `window` columns (ANY_TOKEN before it), flattened.
    word_history: list[int] = field(default_factory=list)
    word_last: list[int] = field(default_factory=list)
    word_prefixes: list[int] = field(default_factory=list)
    # Tokens masked at an entry: EOS and stop tokens before min_tokens, one-token bad words.
    banned_entries: list[int] = field(default_factory=list)
    banned_tokens: list[int] = field(default_factory=list)
    # Entries limited to allowed tokens: the entries, then (index into allowed_entries, token) pairs.
    allowed_entries: list[int] = field(default_factory=list)
    allowed_rows: list[int] = field(default_factory=list)
    allowed_tokens: list[int] = field(default_factory=list)
    bias_entries: list[int] = field(default_factory=list)
    bias_tokens: list[int] = field(default_factory=list)
    bias_values: list[float] = field(default_factory=list)
    min_p: list[float] = field(default_factory=list)  # per entry; [] when no request here has one
    # Entries of requests with a structured output, and the tokens their grammars allow there:
    # per entry, xgrammar's bitmask (bit t % 32 of word t // 32 set: token t allowed), flattened.
    grammar_entries: list[int] = field(default_factory=list)
    grammar_masks: list[int] = field(default_factory=list)
    # Masks still to come, of rows launched before their newest token was back (never on the wire).
    pending: PendingMasks | None = None

    # -- the wire (graphrt.distributed.transport): every list, lengths first ----------------------

    def to_wire(self) -> tuple[list[int], list[float]]:
        """The plan as one int64 and one float64 payload."""
        ints, floats, lengths = [], [], []
        for f in _LIST_FIELDS:
            values = getattr(self, f.name)
            lengths.append(len(values))
            (floats if f.name in _FLOAT_FIELDS else ints).extend(values)
        return [self.window, *lengths, *ints], floats

    @staticmethod
    def from_wire(ints: list[int], floats: list[float]) -> LogitsPlan:
        plan = LogitsPlan(window=ints[0])
        lengths = ints[1 : 1 + len(_LIST_FIELDS)]
        at_int, at_float = 1 + len(_LIST_FIELDS), 0
        for f, length in zip(_LIST_FIELDS, lengths):
            if f.name in _FLOAT_FIELDS:
                setattr(plan, f.name, floats[at_float : at_float + length])
                at_float += length
            else:
                setattr(plan, f.name, ints[at_int : at_int + length])
                at_int += length
        return plan


@dataclass
class PendingMasks:
    """The grammar masks of rows launched before their newest token was on the host: with async
    scheduling a constrained row rides in the micro-batch after the one sampling its token, and its
    mask, which needs that token, is made once the token is read back (`try_fill`, called by
    Ring.fill_pending_masks after every read-back). The last stage waits for them (`ready`) just
    before it masks the logits, so only that wait, not the whole micro-batch, follows the host.
    Only where the last stage samples on a thread of its own (Ring.defers_masks)."""

    rows: list[PendingRow]
    ready: threading.Event = field(default_factory=threading.Event)

    def try_fill(self, plan: LogitsPlan) -> None:
        """Write the masks of every row whose token is back; once all are, the last stage may go on."""
        waiting = []
        for row in self.rows:
            seq = row.seq
            if seq.finished:  # its tokens in this micro-batch are dropped: any mask will do
                words = seq.grammar.all_allowed() * (1 + len(row.drafts))
            elif len(seq.output_ids) < row.num_outputs:
                waiting.append(row)
                continue
            else:
                words = seq.grammar.masks(row.drafts)
            plan.grammar_masks[row.start : row.start + len(words)] = words
        self.rows = waiting
        if not waiting:
            self.ready.set()

    def release(self, plan: LogitsPlan) -> None:
        """The micro-batch is dropped (a stage or a read-back failed, or the ring closes): let the
        last stage go on with every token allowed, so no worker waits for a read-back that will not come."""
        for row in self.rows:
            words = row.seq.grammar.all_allowed() * (1 + len(row.drafts))
            plan.grammar_masks[row.start : row.start + len(words)] = words
        self.rows = []
        self.ready.set()


@dataclass
class PendingRow:
    """A constrained row whose masks wait for its newest token."""

    start: int  # where its words start in plan.grammar_masks
    seq: Any  # its graphrt.engine.sequence.Sequence (the runtime never imports the engine)
    num_outputs: int  # the output tokens it has once that token is back
    drafts: list[int]


_LIST_FIELDS = [f for f in fields(LogitsPlan) if f.name not in ("window", "pending")]
_FLOAT_FIELDS = {"presence", "frequency", "repetition", "bias_values", "min_p"}


def plan_logits(step: ScheduledStep, eos_ids: frozenset[int] | set[int]) -> LogitsPlan | None:
    """A step's logit processing, or None when all its sampled requests keep the defaults.
    `eos_ids`: the model's end tokens, masked with each request's stop tokens before its min_tokens.
    A constrained row whose newest token is not back yet gets its mask later (`PendingMasks`): the
    scheduler launches such a row only where the ring can wait for it (Scheduler.defer_masks)."""
    seqs = step.sampled_seqs
    if not any(seq.params.processes_logits for seq in seqs):
        return None
    plan = LogitsPlan(window=max(seq.params.bad_word_prefix_len for seq in seqs))
    num_entries = sum(step.sample_counts)
    min_p = [0.0] * num_entries
    entry = 0
    for seq, row, count in zip(seqs, step.sample_rows, step.sample_counts):
        params = seq.params
        if params.processes_logits:
            start, query_len = step.starts[row], step.query_lens[row]
            if params.tracks_history and start < seq.prefill_len:  # this step ends its prefill
                _start_history(plan, seq)
            drafts = step.draft_ids[row] if step.draft_ids else []
            # The output index of the token entry 0 samples: its position less the prompt's length.
            first_output = start + query_len - count + 1 - seq.prompt_len
            for j in range(count):
                _plan_entry(plan, seq, entry + j, j, drafts, first_output + j < params.min_tokens, eos_ids)
                min_p[entry + j] = 0.0 if params.greedy else params.min_p  # as vLLM: greedy ignores it
            if seq.grammar is not None:
                plan.grammar_entries += range(entry, entry + count)
                if start >= seq.num_tokens:  # its input is still on the device: its masks come later
                    plan.pending = plan.pending or PendingMasks([])
                    plan.pending.rows.append(PendingRow(len(plan.grammar_masks), seq, start + 1 - seq.prompt_len, drafts))
                    plan.grammar_masks += seq.grammar.all_allowed() * count  # placeholders of the masks' size
                else:
                    plan.grammar_masks += seq.grammar.masks(drafts)
        entry += count
    if not any(seq.params.uses_penalties for seq in seqs):
        plan.presence, plan.frequency, plan.repetition = [], [], []
    if any(min_p):
        plan.min_p = min_p
    # Nothing to do after all (min_tokens all out, min_p only on greedy rows): no plan, no copy of the logits.
    return None if all(not getattr(plan, f.name) for f in _LIST_FIELDS) else plan


def _start_history(plan: LogitsPlan, seq) -> None:
    index = len(plan.init_requests)
    plan.init_requests.append(seq.request_id)
    if seq.params.repetition_penalty != 1:
        plan.init_prompt_tokens += seq.prompt_ids
        plan.init_prompt_owners += [index] * seq.prompt_len
    outputs = list(seq.output_ids)
    plan.init_output_tokens += outputs
    plan.init_output_owners += [index] * len(outputs)
    recent = outputs[-plan.window :] if plan.window else []
    plan.init_recent += [NO_TOKEN] * (plan.window - len(recent)) + recent


def _plan_entry(plan: LogitsPlan, seq, entry: int, num_priors: int, drafts: list[int], before_min_tokens: bool, eos_ids) -> None:
    params = seq.params
    if params.tracks_history:
        history = len(plan.history_entries)
        plan.history_entries.append(entry)
        plan.history_requests.append(seq.request_id)
        plan.history_priors.append(num_priors)
        plan.presence.append(params.presence_penalty)
        plan.frequency.append(params.frequency_penalty)
        plan.repetition.append(params.repetition_penalty)
        for column in range(num_priors):  # the drafts before a verify row's entry
            plan.prior_history.append(history)
            plan.prior_columns.append(column)
            plan.prior_tokens.append(drafts[column])
            plan.prior_samples.append(entry - num_priors + column)
        for word in params.bad_words_token_ids or ():
            if len(word) > 1:
                plan.word_history.append(history)
                plan.word_last.append(word[-1])
                plan.word_prefixes += [ANY_TOKEN] * (plan.window - len(word) + 1) + word[:-1]
    banned = [word[0] for word in params.bad_words_token_ids or () if len(word) == 1]
    if before_min_tokens:
        banned += sorted(set(eos_ids) | set(params.stop_token_ids))
    plan.banned_entries += [entry] * len(banned)
    plan.banned_tokens += banned
    if params.allowed_token_ids is not None:
        plan.allowed_rows += [len(plan.allowed_entries)] * len(params.allowed_token_ids)
        plan.allowed_entries.append(entry)
        plan.allowed_tokens += params.allowed_token_ids
    if params.logit_bias:
        plan.bias_entries += [entry] * len(params.logit_bias)
        plan.bias_tokens += list(params.logit_bias)
        plan.bias_values += [float(v) for v in params.logit_bias.values()]
