"""Greedy sampling's argmax, the torch reference (its compiled CPU twin: elementwise_cpu.py)."""

from __future__ import annotations

import torch


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """(rows, vocab) -> (rows,) int64: each row's index of its largest logit, the first of equal
    ones, a NaN counting as the largest. On the CPU the logits are made float32 first: argmax over
    bfloat16 is 4x slower than converting (exact, so the same ids), 2.9 ms against 0.7 for 32 rows
    of a 49k vocabulary on the build machine."""
    return (logits.float() if logits.device.type == "cpu" else logits).argmax(dim=-1)
