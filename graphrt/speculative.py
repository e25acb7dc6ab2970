"""What `--speculative-config` chooses: the drafter and how many tokens it guesses per step.

The same dict as vLLM's: `{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
"prompt_lookup_min": 2}`, given as JSON on the command line or as a dict to `LLM(speculative_config=...)`.
Plain data with no torch, validated once here. How drafts are made and checked:
graphrt.engine.drafter and docs/speculative.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4  # drafts per row and step: a verify row feeds 1 + this many tokens
    prompt_lookup_max: int = 4  # ngram: the longest n-gram matched
    prompt_lookup_min: int = 2  # ngram: the shortest
    model: str | None = None  # draft_model: the draft model's folder

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.method == "draft_model" and not self.model:
            raise ValueError(
                'the speculative method "draft_model" needs the draft model\'s folder: '
                '{"method": "draft_model", "model": DIR, "num_speculative_tokens": 4}'
            )
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative {name} must be a positive integer, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative prompt_lookup_min ({self.prompt_lookup_min}) is larger than prompt_lookup_max "
                f"({self.prompt_lookup_max}); give min <= max"
            )

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """From a dict, a JSON object (the CLI's --speculative-config), or None (no speculation)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(
                    f"--speculative-config is not valid JSON ({exc.msg}); give e.g. "
                    '\'{"method": "ngram", "num_speculative_tokens": 4}\''
                ) from None
        if not isinstance(value, dict):
            raise ValueError(f"the speculative config must be a JSON object (a dict), got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown speculative config field {', '.join(map(repr, unknown))}; known: {', '.join(sorted(known))}")
        if isinstance(value.get("method"), str):
            value = {**value, "method": value["method"].lower()}  # SGLang spells it NGRAM
        return cls(**value)
