"""What passes from the scheduler to the ring and back: plain data, and the token feed's references.

A leaf module: the scheduler emits a `ScheduledStep`, the ring runs it as a `MicroBatch` and hands
it back with its token ids, and neither imports the other. A step's rows are the engine's
sequences, which the runtime reads only through `Row` and never changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


class Row(Protocol):
    """What the runtime reads of a scheduled sequence (graphrt.engine.sequence.Sequence)."""

    request_id: int
    prompt_ids: list[int]
    output_ids: list[int]  # read back so far
    params: Any  # graphrt.sampling_params.SamplingParams
    generator: Any  # torch.Generator | None: a seeded request's own
    block_ids: list[int]
    num_computed: int
    prefill_len: int
    prompt_logprobs: list

    @property
    def num_tokens(self) -> int: ...

    @property
    def prompt_len(self) -> int: ...

    @property
    def finished(self) -> bool: ...

    def token_at(self, position: int) -> int | None: ...


def feed_ref(feed_index: int):
    """How a step names an input token that is still on the device: -1 - its index in the ring's
    token feed (token ids are never negative). Works on ints and on tensors of them."""
    return -1 - feed_index


def feed_index(ref):
    """The feed index a `feed_ref` names (ints or tensors)."""
    return -1 - ref


def is_feed_ref(token):
    return token < 0


@dataclass
class ScheduledStep:
    """One micro-batch's worth of work, as the scheduler decided it."""

    seqs: list[Row]
    query_lens: list[int]  # tokens each sequence feeds in this step
    is_prefill: bool
    # Each sequence's first position in this step (its computed count when it was scheduled).
    starts: list[int] = field(default_factory=list)
    id: int = -1  # increases in the order steps are scheduled, which is the order they launch and finish in
    sample_rows: list[int] = field(default_factory=list)  # rows that get a token from this step
    # A verify step (speculative decoding): each decode row's guessed next tokens, [] for a row
    # without. A row with d drafts feeds 1 + d tokens and gets a token sampled at each of them;
    # the rows without come first. Empty: no row has drafts. A verify step is decode-shaped: each
    # of its tokens is one row of a decode batch (its own position, context and block table), so
    # it runs the decode graph of the bucket that holds its tokens (graphrt.runtime.ring.build_inputs).
    draft_ids: list[list[int]] = field(default_factory=list)

    sampled_seqs: list[Row] = field(init=False)  # the sequences of sample_rows

    def __post_init__(self) -> None:
        if not self.starts:
            self.starts = [seq.num_computed for seq in self.seqs]
        if not self.sample_rows:
            # A row samples once this step reaches the end of what it has to prefill.
            self.sample_rows = [
                row for row, (seq, start, query_len) in enumerate(zip(self.seqs, self.starts, self.query_lens))
                if start + query_len >= seq.prefill_len
            ]
        self.sampled_seqs = [self.seqs[i] for i in self.sample_rows]

    @property
    def is_verify(self) -> bool:
        return bool(self.draft_ids)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    def num_drafts(self, row: int) -> int:
        return len(self.draft_ids[row]) if self.draft_ids else 0

    @property
    def sample_counts(self) -> list[int]:
        """Tokens each sampled row gets sampled: 1, or 1 + its drafts in a verify step."""
        return [1 + self.num_drafts(row) for row in self.sample_rows]
