"""NVTX ranges in the `graphrt` domain, so an Nsight Systems trace reads like the design.

Attributes (message and colour) are built once per distinct name and reused, so a range costs a
push and a pop. Without a profiler attached (or with NVTX_DISABLE=1) the nvtx package hands out a
no-op domain, and then every range is one shared null context: nothing is pushed at all.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import nvtx
from nvtx._lib.lib import DummyDomain

COLORS = {"stage": "green", "tick": "blue", "prefill": "orange", "sample": "purple", "transfer": "yellow", "capture": "red"}


class Ranges:
    def __init__(self, domain=None):
        self.domain = domain if domain is not None else nvtx.get_domain("graphrt")
        self.enabled = domain is not None or (nvtx.enabled() and not isinstance(self.domain, DummyDomain))
        self._attributes: dict[str, object] = {}
        self._off = nullcontext()

    def _attrs(self, message: str, kind: str):
        attrs = self._attributes.get(message)
        if attrs is None:
            attrs = self._attributes[message] = self.domain.get_event_attributes(message=message, color=COLORS[kind])
        return attrs

    def range(self, message: str, kind: str):
        return self._push(message, kind) if self.enabled else self._off

    @contextmanager
    def _push(self, message: str, kind: str):
        self.domain.push_range(self._attrs(message, kind))
        try:
            yield
        finally:
            self.domain.pop_range()

    def stage(self, stage: int, slot: int, bucket: int):
        """A stage's work on one micro-batch: `stage{s} mb{k} bs{b}` (k: ring slot, b: bucket or tokens)."""
        return self.range(f"stage{stage} mb{slot} bs{bucket}", "stage")

    def tick(self):
        return self.range("scheduler tick", "tick")

    def sample(self):
        return self.range("sample", "sample")

    def transfer(self, stage: int):
        return self.range(f"transfer stage{stage}->stage{stage + 1}", "transfer")

    def prefill(self, stage: int, tokens: int):
        return self.range(f"prefill stage{stage} tokens{tokens}", "prefill")

    def capture(self, stage: int, bucket: int):
        return self.range(f"capture stage{stage} bs{bucket}", "capture")
