"""Greedy sampling's argmax, the torch reference (its compiled CPU twin: kernels/cpu/elementwise.py)."""

from __future__ import annotations

import torch


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """(rows, vocab) -> (rows,) int64: each row's index of its largest logit, the first of equal
    ones, a NaN counting as the largest. On the CPU bfloat16 and float16 logits are made float32
    first (exact, so the same ids): torch's argmax over bfloat16 is 4x slower than the conversion
    and its argmax together, 2.9 ms against 0.7 for 32 rows of a 49k vocabulary on the build machine."""
    if logits.device.type == "cpu" and logits.dtype in (torch.bfloat16, torch.float16):
        logits = logits.float()
    return logits.argmax(dim=-1)
