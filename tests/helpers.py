"""Helpers the tests share."""

from __future__ import annotations

import torch

from graphrt.engine import Engine
from graphrt.sampling import SamplingParams


def prompt_logits(engine: Engine, prompt_ids: list[int]) -> torch.Tensor:
    """Last-position logits of a prompt, computed through the engine's scheduler and stages."""
    seq = engine.add_request(prompt_ids, SamplingParams(max_tokens=1, temperature=0))
    while True:
        step = engine.scheduler.schedule()
        logits = engine.run(step)
        if not seq.in_prefill:
            row = step.seqs.index(seq)
            engine.abort(seq)
            return logits[row].float().cpu()
