"""Which decode attention a CPU stage runs, chosen by timing both on this machine.

Two implementations share one contract (`paged_attention.paged_decode_attention`): the torch
reference, which gathers each sequence's K/V blocks into a new tensor and runs
`scaled_dot_product_attention`, and the compiled kernel (`paged_attention_cpu`), which reads the
blocks in place. The kernel is faster where we have measured it, but it is built on the machine
it runs on, by whatever compiler is there, so a stage times both on its own shapes (its heads,
head size, block size and dtype, at its largest decode bucket, over contexts of up to a few hundred
tokens) and keeps the faster. The calls alternate and each keeps its median, as the matmul choice
does (kernels/matmul_choice.py), so load elsewhere on the machine slows both alike.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch

from graphrt.kernels import mode_from_env as env_mode
from graphrt.kernels import paged_attention

logger = logging.getLogger("graphrt")

PATH_NAMES = {"torch": "torch reference", "compiled": "compiled kernel"}
MODES = ("auto", "torch", "compiled")
MODE_ENV = "GRAPHRT_ATTENTION"  # forces a path for tests and benchmarks; auto (measure) by default
NUM_CALLS = 7  # per path, alternating
MAX_CONTEXT = 384  # tokens: a long chat turn; longer contexts favour the kernel further
MARGIN = 0.05  # the kernel must beat the reference by this much, so noise does not flip a tie


def mode_from_env(environ: Mapping[str, str] = os.environ) -> str:
    return env_mode(MODE_ENV, MODES, environ)


@dataclass(frozen=True)
class AttentionChoice:
    """The decode attention of a stage, and why."""

    path: str  # torch | compiled
    source: str  # measured | forced (GRAPHRT_ATTENTION) | only (the kernel can't run here: `note`)
    seconds: dict[str, float] = field(default_factory=dict)  # path -> median s per call, when measured
    rows: int = 0
    note: str | None = None

    @property
    def function(self) -> Callable[..., torch.Tensor]:
        if self.path == "compiled":
            from graphrt.kernels import paged_attention_cpu

            return paged_attention_cpu.paged_decode_attention
        return paged_attention.paged_decode_attention

    def summary(self) -> str:
        """One line for the start-up banner."""
        line = f"decode attention: {PATH_NAMES[self.path]}"
        if self.source == "measured":
            times = " vs ".join(f"{self.seconds[p] * 1e3:.2f} ms" for p in ("compiled", "torch"))
            return f"{line} ({times} per layer at {self.rows} rows, compiled vs torch)"
        if self.source == "forced":
            return f"{line} (forced by {MODE_ENV})"
        return f"{line} ({self.note})"


def random_decode_inputs(
    rows: int, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype, seed: int = 0
) -> tuple:
    """Arguments for one decode attention call: `rows` sequences of up to MAX_CONTEXT tokens, each in
    its own blocks of a cache that holds just them."""
    generator = torch.Generator().manual_seed(seed)
    seq_lens = torch.randint(1, MAX_CONTEXT + 1, (rows,), generator=generator)
    width = -(-MAX_CONTEXT // block_size)
    num_blocks = 1 + rows * width
    tables = (torch.randperm(num_blocks - 1, generator=generator) + 1).view(rows, width)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=generator).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=generator).to(dtype)
    q = torch.randn(rows, num_heads, head_dim, generator=generator).to(dtype)
    return q, k_cache, v_cache, tables, seq_lens, head_dim**-0.5, int(seq_lens.max())


def time_paths(
    paths: Mapping[str, Callable[..., torch.Tensor]], inputs: tuple, timer: Callable[[], float] = time.perf_counter
) -> dict[str, float]:
    """Median seconds per call of each path, the paths alternating call by call."""
    for run in paths.values():
        run(*inputs)  # the first call may allocate or warm a code path
    samples: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(NUM_CALLS):
        for name, run in paths.items():
            began = timer()
            run(*inputs)
            samples[name].append(timer() - began)
    return {name: statistics.median(values) for name, values in samples.items()}


def choose_decode_attention(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    rows: int,
    mode: str = "auto",
    timer: Callable[[], float] = time.perf_counter,
) -> AttentionChoice:
    """The decode attention for a CPU stage of these shapes, at `rows` rows (its largest decode
    bucket); a forced `mode` comes first. A CUDA stage has no choice: it runs its kernel set's."""
    if device.type != "cpu":
        raise ValueError(f"only a CPU stage chooses its decode attention; a {device.type} stage runs its kernel set's")
    if mode not in MODES:
        raise ValueError(f"decode attention mode must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "torch":
        return AttentionChoice("torch", "forced")
    from graphrt.kernels import paged_attention_cpu  # builds the kernel on first use

    reason = paged_attention_cpu.unavailable_reason(dtype, device)
    if reason is not None:
        if mode == "compiled":
            raise ValueError(f"{MODE_ENV}=compiled, but the compiled decode attention can't run here: {reason}")
        logger.warning("decode attention: the torch reference, as the compiled kernel can't run here: %s", reason)
        return AttentionChoice("torch", "only", note=f"the compiled kernel can't run here: {reason}")
    if mode == "compiled":
        return AttentionChoice("compiled", "forced")
    inputs = random_decode_inputs(rows, num_heads, num_kv_heads, head_dim, block_size, dtype)
    seconds = time_paths(
        {"compiled": paged_attention_cpu.paged_decode_attention, "torch": paged_attention.paged_decode_attention}, inputs, timer
    )
    path = "compiled" if seconds["compiled"] < seconds["torch"] * (1 - MARGIN) else "torch"
    return AttentionChoice(path, "measured", seconds, rows)
