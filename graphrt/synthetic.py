"""Synthetic stages: real stages that also take a known time, for measuring the ring itself.

Each stage's forward sleeps `stage_ms` (a sleep releases the GIL, as a GPU kernel would free the
host) and the host spends `host_ms` on every micro-batch it reads back (standing in for
detokenizing, stop checks and streaming). With these known, the pipeline formula in
docs/profiling.md predicts each stage's busy share, and the timeline measures it.
"""

from __future__ import annotations

import time

from graphrt.engine import Engine


def make_synthetic(engine: Engine, stage_ms: float, host_ms: float = 0.0) -> Engine:
    for stage in engine.pipeline.stages:
        forward = stage.forward

        def slow_forward(x, meta, cache, forward=forward):
            time.sleep(stage_ms / 1000)
            return forward(x, meta, cache)

        stage.forward = slow_forward
    if host_ms:
        account = engine._account

        def slow_account(mb, now, account=account):
            time.sleep(host_ms / 1000)
            account(mb, now)

        engine._account = slow_account
    return engine


def predicted_busy_fraction(pp: int, depth: int, stage_s: float, host_s: float) -> float:
    """Steady-state busy share of each stage: a slot comes back after it crossed all stages and the
    host handled it (pp * T + h), while the stage has L = pp + depth micro-batches of T to run in
    that time: busy = L * T / max(L * T, pp * T + h)."""
    ring = pp + depth
    return ring * stage_s / max(ring * stage_s, pp * stage_s + host_s)
