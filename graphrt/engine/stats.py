"""What the engine counts as it runs; the CLI and benchmarks turn the counters into rates."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineStats:
    """Counters since the engine started."""

    prefill_tokens: int = 0
    decode_steps: int = 0  # decode micro-batches read back
    decode_tokens: int = 0  # tokens they gave to requests (not counting a dropped one after EOS)
    decode_seconds: float = 0.0  # the union of the intervals in which a decode micro-batch was in flight

    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0

    def weight_gb_per_s(self, weight_bytes: int) -> float:
        """Achieved weight bandwidth: every decode step reads all weights once."""
        return weight_bytes * self.decode_steps / self.decode_seconds / 1e9 if self.decode_seconds else 0.0
