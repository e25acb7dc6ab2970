"""Drafters: cheap guesses of a sequence's next tokens, which one verify step checks at once.

`NgramDrafter` (prompt lookup) finds the latest earlier place where the sequence's last n tokens
occurred, in its prompt or output, and proposes the tokens that followed there: no model, and right
whenever the output copies its context (editing code, quoting, summaries that reuse phrases). n goes
from `prompt_lookup_max` down to `prompt_lookup_min`; the longest match wins.
"""

from __future__ import annotations

from graphrt.speculative import SpeculativeConfig


class NgramDrafter:
    def __init__(self, num_tokens: int, min_n: int, max_n: int):
        self.num_tokens = num_tokens
        self.min_n, self.max_n = min_n, max_n

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        """Up to min(num_tokens, limit) tokens that followed the latest earlier occurrence of the
        last n tokens of `tokens`, for the largest n with one; [] where none occurs."""
        limit = min(limit, self.num_tokens)
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


def make_drafter(config: SpeculativeConfig | None) -> NgramDrafter | None:
    if config is None:
        return None
    return NgramDrafter(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)
