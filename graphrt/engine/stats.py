"""What the engine counts as it runs; the CLI and benchmarks turn the counters into rates."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineStats:
    """Counters since the engine started."""

    prefill_tokens: int = 0
    decode_steps: int = 0  # decode micro-batches read back
    decode_tokens: int = 0  # tokens they gave to requests (not counting a dropped one after EOS)
    decode_seconds: float = 0.0  # the union of the intervals in which a decode micro-batch was in flight
    # Weight bytes those micro-batches read: all weights each for a dense model; for a mixture of
    # experts the dense ones plus the experts their routing chose (WeightReads.decode_bytes).
    decode_weight_bytes: float = 0.0
    spec: SpecStats = field(default_factory=lambda: SpecStats())

    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0

    def weight_gb_per_s(self) -> float:
        """Achieved weight bandwidth: the weight bytes decode steps read, over their time."""
        return self.decode_weight_bytes / self.decode_seconds / 1e9 if self.decode_seconds else 0.0


@dataclass
class SpecStats:
    """Speculative decoding, as vLLM counts it: rows verified with drafts, drafts, accepted drafts,
    and accepted drafts by position (the first draft of a row, the second, ...)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_drafted:
            self.accepted_per_position += [0] * (num_drafted - len(self.accepted_per_position))
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def copy(self) -> SpecStats:
        return SpecStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens, list(self.accepted_per_position))

    def since(self, before: SpecStats) -> SpecStats:
        """What was counted after `before` (an earlier copy)."""
        earlier = before.accepted_per_position + [0] * (len(self.accepted_per_position) - len(before.accepted_per_position))
        return SpecStats(
            self.num_drafts - before.num_drafts, self.num_draft_tokens - before.num_draft_tokens,
            self.num_accepted_tokens - before.num_accepted_tokens,
            [now - then for now, then in zip(self.accepted_per_position, earlier)],
        )

    def describe(self) -> str:
        """One line for `graphrt generate` and `graphrt bench`."""
        return (
            f"speculative decoding: {self.num_drafts} verify rows, {self.num_accepted_tokens} of "
            f"{self.num_draft_tokens} drafts accepted ({self.acceptance_rate:.0%}), "
            f"{self.mean_accepted:.2f} tokens per verify row"
        )

    @property
    def mean_accepted(self) -> float:
        """Tokens a verify row gave on average: its accepted drafts plus the one it always samples."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
