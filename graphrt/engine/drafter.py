"""Drafters: cheap guesses of a sequence's next tokens, which one verify step checks at once.

`NgramDrafter` (prompt lookup) finds the latest earlier place where the sequence's last n tokens
occurred, in its prompt or output, and proposes the tokens that followed there: no model, and right
whenever the output copies its context (editing code, quoting, summaries that reuse phrases). n goes
from `prompt_lookup_max` down to `prompt_lookup_min`; the longest match wins.

`drafts_that_pay` decides how many of the drafts to verify: a verify step's tokens are rows of the
decode batch, so drafts make the step's bucket larger; they are worth it only while the tokens they
are expected to add outrun the time the larger bucket costs (`StepCosts`, measured at start-up).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Protocol

# Draft acceptance of a sequence that has not been verified yet, as counts: one kept of two.
PRIOR_KEPT, PRIOR_TRIED = 1.0, 2.0
ACCEPTANCE_MEMORY = 64.0  # drafts tried: past this, earlier outcomes count half as much


class Drafter(Protocol):
    """What the scheduler asks of a drafter (this module's NgramDrafter, or
    graphrt.engine.draft_model.DraftModelDrafter, which the engine builds since it needs torch)."""

    num_tokens: int  # drafts per row and step, at most
    # What a round of guesses costs, by rows guessed for: a model step each (draft_model), so how
    # many to make is chosen before making them; None: guessing is free next to a step (ngram),
    # so the guesses are made first and the choice is among them.
    guess_costs: StepCosts | None

    def propose_batch(self, requests: list[tuple[int, list[int], int]]) -> list[list[int]]:
        """For each (request id, tokens so far, limit): up to `limit` guesses of the tokens that
        follow; [] where it has none. The caller (graphrt.engine.speculation) sets the limits: at
        most num_tokens, and one more for a row whose newest token is still being sampled (its
        first guess is of that token)."""

    def release(self, request_id: int) -> None:
        """The request has ended or was preempted: whatever the drafter keeps for it goes."""

    def measure_guess_costs(self, row_counts: list[int]) -> None:
        """Before any request: where guessing costs a model step, time a round of it for each
        number of rows in `row_counts` and set `guess_costs`; otherwise nothing."""


class NgramDrafter:
    guess_costs = None  # a lookup in the row's tokens

    def __init__(self, num_tokens: int, min_n: int, max_n: int):
        self.num_tokens = num_tokens
        self.min_n, self.max_n = min_n, max_n

    def propose_batch(self, requests: list[tuple[int, list[int], int]]) -> list[list[int]]:
        return [self.propose(tokens, limit) for _, tokens, limit in requests]

    def release(self, request_id: int) -> None:
        pass  # it keeps nothing between steps

    def measure_guess_costs(self, row_counts: list[int]) -> None:
        pass  # a lookup costs nothing next to a step

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        """Up to `limit` tokens that followed the latest earlier occurrence of the last n tokens of
        `tokens`, for the largest n with one; [] where none occurs."""
        if limit <= 0:
            return []
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            pattern = tokens[-n:]
            first = pattern[0]
            # Latest start first; a match must end before the last token, so something follows it.
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start] == first and tokens[start : start + n] == pattern:
                    return continue_from(tokens, start + n, limit)
        return []


def continue_from(tokens: list[int], source: int, count: int) -> list[int]:
    """`count` tokens copied from `tokens[source:]` on, a copy that reaches the end going on with
    what it copied: a run repeating every p tokens goes on repeating (p < count)."""
    copied = tokens[source : source + count]
    period = len(tokens) - source
    while len(copied) < count:
        copied.append(copied[len(copied) - period])
    return copied


@dataclass
class Acceptance:
    """How likely a sequence's next draft is to be kept, given the one before it was: each draft
    verified is a try, kept or not, and a verify step ends at its first miss. Recent steps weigh
    more, so a sequence that stops copying its context stops drafting soon."""

    kept: float = PRIOR_KEPT
    tried: float = PRIOR_TRIED

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.kept += num_accepted
        self.tried += num_accepted + (num_accepted < num_drafts)  # the first miss is the last draft tried
        if self.tried > ACCEPTANCE_MEMORY:
            self.kept, self.tried = self.kept / 2, self.tried / 2

    @property
    def rate(self) -> float:
        return self.kept / self.tried


@dataclass(frozen=True)
class StepCosts:
    """Seconds a decode micro-batch takes, by bucket (graphrt.runtime.ring.Ring.time_decode_steps),
    or a round of a draft model's guesses, by rows (Drafter.measure_guess_costs)."""

    seconds: dict[int, float]
    buckets: list[int] = field(init=False)  # the keys of `seconds`, sorted once: read every tick

    def __post_init__(self) -> None:
        object.__setattr__(self, "buckets", sorted(self.seconds))

    def __call__(self, num_tokens: int) -> float:
        """What a step of `num_tokens` rows costs: its bucket's time."""
        buckets = self.buckets
        return self.seconds[buckets[min(bisect.bisect_left(buckets, num_tokens), len(buckets) - 1)]]

    def describe(self, what: str = "decode step ms by bucket") -> str:
        return f"{what} " + ", ".join(f"{b}: {s * 1000:.1f}" for b, s in sorted(self.seconds.items()))


def drafts_that_pay(
    num_rows: int, candidates: list[tuple[float, int]], max_drafts: int, costs: StepCosts | None,
    guess_costs: StepCosts | None = None, leads: list[int] | None = None,
) -> list[int]:
    """How many drafts to verify for each candidate row of a decode step of `num_rows` rows, where
    candidate i proposes `candidates[i][1]` drafts kept at rate `candidates[i][0]` each (given the
    ones before it): at most `max_drafts` in all, the count that gives the most expected tokens per
    second of the step. Draft j of a row adds rate^j expected tokens, so the drafts are taken
    best first; without costs every draft is taken (up to `max_drafts`). With `guess_costs`
    (drafts not made yet), making them costs a round of guesses for the rows that draft, as many
    rounds as the deepest row needs: its drafts plus its `leads` entry (1 for a row whose newest
    token is still on the device, whose first round guesses that token)."""
    gains = sorted(
        ((rate**j, j, row) for row, (rate, length) in enumerate(candidates) for j in range(1, length + 1)),
        key=lambda gain: -gain[0],  # stable: a row's drafts stay in order, the rows' ties in row order
    )[: max(0, max_drafts)]
    best = len(gains)
    if costs is not None:
        expected, best, best_rate = float(num_rows), 0, num_rows / costs(num_rows)
        depth, drafting = 0, set()
        for count, (gain, j, row) in enumerate(gains, start=1):
            expected += gain
            depth, seconds = max(depth, j + (leads[row] if leads else 0)), costs(num_rows + count)
            drafting.add(row)
            if guess_costs is not None:
                seconds += depth * guess_costs(len(drafting))
            rate = expected / seconds
            if rate > best_rate:
                best, best_rate = count, rate
    lengths = [0] * len(candidates)
    for _, _, row in gains[:best]:
        lengths[row] += 1
    return lengths
