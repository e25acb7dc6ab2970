"""The scheduler's speculative decoding: which rows of a decode batch draft, how many of their
drafts are verified, and what a verify row keeps.

The scheduler (graphrt.engine.scheduler) owns the request state and the KV blocks: it builds the
verify step from the drafts chosen here, takes blocks for them, and gives back what a row did not
keep. `Speculation` decides, from the drafter's guesses and what the steps cost
(graphrt.engine.drafter), and keeps on each row what the next decision needs: how often its drafts
are kept, and how long it pauses after drafts that all missed.
"""

from __future__ import annotations

from graphrt.engine.drafter import Drafter, StepCosts, drafts_that_pay
from graphrt.engine.sequence import Sequence
from graphrt.engine.stats import SpecStats

MAX_DRAFT_PAUSE = 64  # decode steps a row goes at most without drafting after verify steps that kept nothing
HOST_GAP_WEIGHT = 0.1  # of each new measurement in Speculation.host_gap's moving average


def accept_drafts(drafts: list[int], sampled: list[int]) -> list[int]:
    """The tokens a verify row keeps: `sampled[j]` is the token sampled where draft j + 1 (or for
    the last, the next token) goes, given the drafts before it. Each draft is kept while it equals
    the token sampled in its place, and the first sampled token that differs (or the one after the
    last draft) ends the run. Greedy, this is the target's argmax run; sampling, each draft is kept
    with the probability p(draft) the target gives it and on a miss the token comes from p without
    the draft: speculative rejection sampling against a draft that is sure of its token."""
    kept = 0
    while kept < len(drafts) and drafts[kept] == sampled[kept]:
        kept += 1
    return sampled[: kept + 1]


class Speculation:
    """The scheduler's own part for speculative decoding (it makes one, and calls it only from its
    schedule and update): it writes a row's draft pause, backoff and acceptance, which the scheduler
    never reads; everything else of the row stays the scheduler's."""

    def __init__(self, drafter: Drafter, stats: SpecStats):
        self.drafter = drafter
        # What a decode step of each bucket costs, which drafts must pay for; None: every draft goes
        # (the engine measures them at start-up: Ring.time_decode_steps).
        self.step_costs: StepCosts | None = None
        # Seconds the device waits for the host between a read-back and the next launch: what a
        # step that waits for its verify rows pays (measured by the engine, record_host_gap).
        self.host_gap = 0.0
        self.stats = stats

    def record_host_gap(self, seconds: float) -> None:
        """The engine saw the device wait `seconds` from a read-back to the next decode launch; a
        wait longer than the dearest step (the caller held the engine) counts as that step."""
        if self.step_costs is not None:
            seconds = min(seconds, max(self.step_costs.seconds.values()))
        self.host_gap += HOST_GAP_WEIGHT * (seconds - self.host_gap)

    def waits_for_verify_rows(self, num_ready: int, num_verifying: int) -> bool:
        """Whether a step launched ahead should rather wait for the `num_verifying` rows whose
        verify steps are in flight before it: those rows' next input is known only once their
        kept tokens are back (the drafter reads them on the host), so launching the `num_ready`
        rows now splits the batch in two steps, each reading every weight. Wait when the two
        steps cost more than one step of all the rows plus the device's wait for the host. Steps
        are priced by their rows; the drafts they will carry pay for themselves (drafts_that_pay)."""
        costs = self.step_costs
        if costs is None or not num_verifying or not num_ready:
            return False
        return costs(num_ready) + costs(num_verifying) > costs(num_ready + num_verifying) + self.host_gap

    def choose_drafts(self, batch: list[Sequence], max_drafts: int) -> list[tuple[Sequence, list[int]]]:
        """The drafts worth verifying for rows of the decode batch `batch`, at most `max_drafts` in
        all (the room its largest bucket leaves): those that pay for the larger bucket they make
        (`drafts_that_pay`). A row pausing after drafts that missed counts its pause down instead."""
        drafting = []
        for seq in batch:
            if self._may_draft(seq):
                drafting.append(seq)
            else:
                seq.draft_pause = max(0, seq.draft_pause - 1)
        if self.drafter.guess_costs is None:  # guesses cost nothing: make them, then choose among them
            proposals = [(seq, proposed) for seq, proposed in zip(drafting, self._propose(drafting)) if proposed]
            lengths = drafts_that_pay(
                len(batch), [(seq.draft_acceptance.rate, len(proposed)) for seq, proposed in proposals],
                max_drafts, self.step_costs,
            )
            return [(seq, proposed[:length]) for (seq, proposed), length in zip(proposals, lengths) if length]
        # Guesses cost a model step a round: choose how many first, then make only those.
        lengths = drafts_that_pay(
            len(batch), [(seq.draft_acceptance.rate, self._limit(seq)) for seq in drafting],
            max_drafts, self.step_costs, self.drafter.guess_costs, leads=[int(seq.awaits_token) for seq in drafting],
        )
        chosen = [(seq, length) for seq, length in zip(drafting, lengths) if length]
        guessed = self._propose([seq for seq, _ in chosen], [length for _, length in chosen])
        return [(seq, proposed) for (seq, _), proposed in zip(chosen, guessed) if proposed]

    def keep(self, seq: Sequence, drafts: list[int], sampled: list[int] | None) -> tuple[list[int], int]:
        """What a verify row keeps, given the tokens `sampled` at its positions (None, or a row that
        finished meanwhile: nothing): its tokens, and how many of its `drafts` they accept; counted
        in the stats and the row's acceptance. A row that kept no draft pauses before drafting again."""
        kept = accept_drafts(drafts, sampled) if sampled is not None and not seq.finished else []
        num_accepted = max(0, len(kept) - 1)
        self.stats.record(len(drafts), num_accepted)
        seq.draft_acceptance.record(len(drafts), num_accepted)
        if num_accepted:
            seq.draft_backoff = 0
        else:  # try again after 1, 3, 7, ... decode steps, so what can't be guessed costs little
            seq.draft_backoff = min(2 * seq.draft_backoff + 1, MAX_DRAFT_PAUSE)
            seq.draft_pause = seq.draft_backoff
        return kept, num_accepted

    def release(self, seq: Sequence) -> None:
        """`seq` ended or was preempted: what the drafter keeps for it goes."""
        self.drafter.release(seq.request_id)

    def _may_draft(self, seq: Sequence) -> bool:
        """Not while a row pauses after drafts that missed."""
        return not seq.draft_pause

    def _limit(self, seq: Sequence) -> int:
        """The most drafts `seq`'s next step may carry: its 1 + d tokens stay within max_tokens."""
        return min(self.drafter.num_tokens, seq.max_tokens - seq.outputs_scheduled - 1)

    def _propose(self, seqs: list[Sequence], limits: list[int] | None = None) -> list[list[int]]:
        """The drafter's guesses for each sequence's next step, up to its limit (default: its
        `_limit`); [] where it has none. A sequence whose newest token is still being sampled
        (async scheduling) has the drafter guess that token too, from the tokens the host has, and
        drafts what follows the guess."""
        if limits is None:
            limits = [self._limit(seq) for seq in seqs]
        requests = [
            (seq.request_id, seq.prompt_ids + seq.output_ids, limit + (1 if seq.awaits_token else 0))
            for seq, limit in zip(seqs, limits)
        ]
        proposed = self.drafter.propose_batch(requests) if requests else []
        return [guesses[1:] if seq.awaits_token else guesses for seq, guesses in zip(seqs, proposed)]
