"""NVTX ranges in the `graphrt` domain, so an Nsight Systems trace reads like the design.

Attributes (message and colour) are built once per distinct name and reused, so a range costs a
push and a pop. Without a profiler attached (or with NVTX_DISABLE=1) every range is one shared
null context: nothing is pushed at all.

Where the ranges go, first that works:
1. the `nvtx` package: the `graphrt` domain, with colours; it knows whether a profiler is attached.
2. `torch.cuda.nvtx` (GPU images often have NVIDIA's C library inside torch but not the package):
   plain ranges, no domain or colour; on when Nsight Systems injects itself (NVTX_INJECTION64_PATH).
3. nothing: ranges are no-ops, and the engine runs the same.
`graphrt doctor` prints which one is active.
"""

from __future__ import annotations

import os
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

COLORS = {"stage": "green", "tick": "blue", "prefill": "orange", "sample": "purple", "transfer": "yellow", "capture": "red", "verify": "cyan", "draft": "magenta", "experts": "darkgreen"}


class TorchNvtxDomain:
    """`torch.cuda.nvtx` behind the nvtx package's domain interface: the message is the attribute."""

    def get_event_attributes(self, message: str, color: str) -> str:
        return message

    def push_range(self, attributes: str) -> None:
        torch.cuda.nvtx.range_push(attributes)

    def pop_range(self) -> None:
        torch.cuda.nvtx.range_pop()


@dataclass(frozen=True)
class NvtxBackend:
    name: str  # "nvtx" | "torch.cuda.nvtx" | "none"
    domain: object | None  # where ranges are pushed; None when no backend exists
    enabled: bool  # whether pushing reaches a profiler now
    why: str  # for `graphrt doctor`


def find_backend() -> NvtxBackend:
    """The first NVTX implementation this process can use, and whether a profiler is listening."""
    disabled = bool(os.environ.get("NVTX_DISABLE"))
    try:
        import nvtx
        from nvtx._lib.lib import DummyDomain
    except ImportError:
        nvtx = None
    if nvtx is not None:
        domain = nvtx.get_domain("graphrt")
        enabled = nvtx.enabled() and not isinstance(domain, DummyDomain)
        return NvtxBackend("nvtx", domain, enabled, "the nvtx package, domain graphrt, with colours")
    if hasattr(torch._C, "_nvtx"):  # only CUDA builds of torch carry NVIDIA's NVTX library
        listening = "NVTX_INJECTION64_PATH" in os.environ and not disabled
        return NvtxBackend("torch.cuda.nvtx", TorchNvtxDomain(), listening, "torch.cuda.nvtx (no nvtx package): ranges without domain or colour")
    return NvtxBackend("none", None, False, "none: neither the nvtx package nor a CUDA build of torch, so ranges are no-ops")


class Ranges:
    def __init__(self, domain=None):
        if domain is not None:  # an injected domain (tests, benchmarks) is always used
            self.backend = NvtxBackend("injected", domain, True, "a domain given by the caller")
        else:
            self.backend = find_backend()
        self.domain = self.backend.domain
        self.enabled = self.backend.enabled
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

    def verify(self, stage: int, slot: int, tokens: int):
        """A stage's work on a speculative verify micro-batch (a decode graph): `verify stage{s} mb{k} tokens{t}`."""
        return self.range(f"verify stage{stage} mb{slot} tokens{tokens}", "verify")

    def draft(self, rows: int, rounds: int):
        """A draft model's guesses for a decode step (on the scheduler's thread): `draft rows{r} rounds{n}`."""
        return self.range(f"draft rows{rows} rounds{rounds}", "draft")

    def experts(self, part: str):
        """Under expert parallelism, a sparse layer's parts on this rank: `experts dispatch` (its pairs
        picked out), `experts run` (its experts on them), `experts combine` (the all-reduce)."""
        return self.range(f"experts {part}", "experts")

    def capture(self, stage: int, bucket: int):
        return self.range(f"capture stage{stage} bs{bucket}", "capture")
