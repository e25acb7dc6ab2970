"""Which kernels a CPU stage runs: compiled or torch reference, chosen op by op by timing both here.

Each op of a decoder layer's hot path has two implementations with one contract: the torch
reference (paged_attention, rmsnorm, rotary, activation) and the compiled kernel (csrc/, built on
this machine by whatever compiler is here: kernels/cpu/paged_attention.py, kernels/cpu/elementwise.py). A stage times both
on its own shapes at its largest decode bucket (decode attention over contexts of up to a few
hundred tokens) and keeps, per op, the compiled kernel only where it is faster by a margin. The calls
alternate and each keeps its median, as the matmul choice does (kernels/cpu/matmul_choice.py), so load
elsewhere on the machine slows both alike.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch

from graphrt.kernels.cpu.forcing import ForcedModes, as_forced
from graphrt.kernels.cpu.forcing import mode_from_env as env_mode
from graphrt.kernels.torch_ops import TORCH

logger = logging.getLogger("graphrt")

MODES = ("auto", "torch", "compiled")
MODE_ENV = "GRAPHRT_CPU_KERNELS"  # forces paths, for every op or by name (tests, benchmarks); auto (measure) by default
NUM_CALLS = 7  # per path, alternating
MAX_CONTEXT = 384  # tokens: a long chat turn; longer contexts favour the compiled attention further
MARGIN = 0.05  # the kernel must beat the reference by this much, so noise does not flip a tie
OPS = ("paged_decode_attention", "paged_prefill_attention", "write_kv", "rms_norm", "apply_rotary", "silu_and_mul")  # KernelSet fields
OP_NAMES = {"paged_decode_attention": "decode attention", "paged_prefill_attention": "prefill attention",
            "write_kv": "KV writes", "apply_rotary": "rotary"}
PREFILL_PROMPTS, PREFILL_TOKENS = 4, 128  # prefill attention is timed on a chunk of 4 prompts of 128 tokens
# The ops graphrt::decode_layers (csrc/decode_layers_cpu.cpp) runs a decode step's layers with, all
# compiled. One call saves 4-10% of a step, more than a tie on one op is worth, so within the margin
# these keep the compiled kernel, and torch's reference must win by the margin to be taken.
DECODE_LAYER_OPS = ("rms_norm", "apply_rotary", "write_kv", "paged_decode_attention", "silu_and_mul")


# Besides the ops, GRAPHRT_CPU_KERNELS names the sampler's greedy argmax and the one-call decode step
# (graphrt::decode_layers, which runs wherever every layer qualifies unless it is turned off).
FORCEABLE = {**{op: MODES for op in OPS}, "greedy_argmax": MODES, "decode_layers": ("auto", "off")}


def mode_from_env(environ: Mapping[str, str] = os.environ) -> ForcedModes:
    """GRAPHRT_CPU_KERNELS: a path for every op (`compiled`), or by op (`paged_prefill_attention=torch`,
    the others measured; `rms_norm=torch,compiled`), and `decode_layers=off`."""
    return env_mode(MODE_ENV, MODES, environ, FORCEABLE)


@dataclass(frozen=True)
class LayerShapes:
    """What the timed calls are shaped by: one decoder layer's sizes."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    # Latent attention (MLA): the width of its cache row, over which decode attention runs as
    # multi-query attention (graphrt.kernels.cpu.paged_attention.paged_latent_decode_attention).
    latent_cache_dim: int | None = None

    @classmethod
    def of(cls, cfg) -> LayerShapes:
        """From a graphrt.model.config.ModelConfig."""
        return cls(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size, cfg.intermediate_size,
                   cfg.mla.cache_dim if cfg.mla is not None else None)


def compiled_ops() -> dict[str, Callable]:
    from graphrt.kernels.cpu import elementwise, paged_attention  # builds the kernels on first use

    return {
        "paged_decode_attention": paged_attention.paged_decode_attention,
        "paged_prefill_attention": paged_attention.paged_prefill_attention,
        "write_kv": paged_attention.write_kv,
        "rms_norm": elementwise.rms_norm,
        "apply_rotary": elementwise.apply_rotary,
        "silu_and_mul": elementwise.silu_and_mul,
    }


TORCH_OPS: dict[str, Callable] = {op: getattr(TORCH, op) for op in OPS}


@dataclass(frozen=True)
class CpuKernelChoice:
    """The kernels of a CPU stage, op by op, and why."""

    paths: dict[str, str]  # op (a KernelSet field) -> torch | compiled
    # measured (some ops timed) | forced (GRAPHRT_CPU_KERNELS) | cached (the graph cache's, some
    # perhaps forced) | only (the kernels can't run here: `note`)
    source: str
    seconds: dict[str, dict[str, float]] = field(default_factory=dict)  # op -> path -> median s per call (the timed ops)
    rows: int = 0
    note: str | None = None
    # Where not every op's path came the same way: op -> forced | cached | fused (`choose_cpu_kernels`'s
    # fused_silu; the timed ops are in `seconds`).
    settled: dict[str, str] = field(default_factory=dict)
    one_call: bool = True  # whether a decode step's layers may run in one call (GRAPHRT_CPU_KERNELS=decode_layers=off)

    @classmethod
    def everywhere(cls, path: str, source: str, note: str | None = None, one_call: bool = True) -> CpuKernelChoice:
        return cls({op: path for op in OPS}, source, note=note, one_call=one_call)

    def functions(self) -> dict[str, Callable]:
        """op -> the function that runs it."""
        compiled = compiled_ops() if "compiled" in self.paths.values() else {}
        return {op: compiled[op] if path == "compiled" else TORCH_OPS[op] for op, path in self.paths.items()}

    def summary(self) -> str:
        """One line for the start-up banner."""
        name = lambda op: OP_NAMES.get(op, op)  # noqa: E731
        compiled = [name(op) for op in OPS if self.paths[op] == "compiled"]
        line = "CPU kernels: " + (f"compiled {', '.join(compiled)}" if compiled else "torch references")
        if len(compiled) not in (0, len(OPS)):
            line += f"; torch {', '.join(name(op) for op in OPS if self.paths[op] == 'torch')}"
        why = []
        if self.source == "measured":
            times = ", ".join(
                f"{name(op)} {self.seconds[op]['compiled'] * 1e3:.3f} vs {self.seconds[op]['torch'] * 1e3:.3f}" for op in self.seconds
            )
            why.append(f"ms per call at {self.rows} rows, prefill attention on {PREFILL_PROMPTS} prompts of "
                       f"{PREFILL_TOKENS} tokens, compiled vs torch: {times}")
        elif self.source == "only":
            why.append(self.note)
        settled_words = (
            ("forced", f"forced by {MODE_ENV}"), ("cached", "from the graph cache"), ("fused", "in the gate/up matmuls' pass"),
        )
        for how, words in settled_words:
            ops = [op for op in OPS if self.settled.get(op) == how]
            if self.source == how and len(ops) in (0, len(OPS)):
                why.append(words)  # every op, or (`settled` empty) every op came this way
            elif ops:
                why.append(f"{', '.join(map(name, ops))} {words}")
        line = f"{line} ({'; '.join(why)})"
        return line if self.one_call else f"{line}; decode layers one by one ({MODE_ENV}=decode_layers=off)"

    def to_json(self) -> dict:
        """What a graph cache records: each op's path."""
        return dict(self.paths)


def timing_inputs(op: str, shapes: LayerShapes, rows: int, block_size: int, dtype: torch.dtype, seed: int = 0) -> tuple:
    """Arguments for one call of `op` at `rows` rows of this layer's shapes (random values)."""
    generator = torch.Generator().manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=generator).to(dtype)  # noqa: E731
    if op == "paged_decode_attention":
        if shapes.latent_cache_dim is not None:  # what latent attention runs on it: one KV head, the whole row
            return random_decode_inputs(rows, shapes.num_heads, 1, shapes.latent_cache_dim, block_size, dtype, seed)
        return random_decode_inputs(rows, shapes.num_heads, shapes.num_kv_heads, shapes.head_dim, block_size, dtype, seed)
    if op == "paged_prefill_attention":  # whole prompts, so every query token but the first sees several
        q, k_cache, v_cache, tables, _, scale, _ = random_decode_inputs(
            PREFILL_PROMPTS, shapes.num_heads, shapes.num_kv_heads, shapes.head_dim, block_size, dtype, seed
        )
        if tables.shape[1] * block_size < PREFILL_TOKENS:
            raise ValueError(f"prefill timing needs {PREFILL_TOKENS}-token contexts; MAX_CONTEXT is {MAX_CONTEXT}")
        q = randn(PREFILL_PROMPTS * PREFILL_TOKENS, shapes.num_heads, shapes.head_dim)
        lens = [PREFILL_TOKENS] * PREFILL_PROMPTS
        return q, k_cache, v_cache, tables, lens, lens, scale
    if op == "write_kv":  # one decode step's rows into distinct slots of the decode timing's cache
        _, k_cache, v_cache, *_ = random_decode_inputs(rows, shapes.num_heads, shapes.num_kv_heads, shapes.head_dim,
                                                       block_size, dtype, seed)
        slots = torch.randperm(k_cache.shape[0] * block_size, generator=generator)[:rows]
        k, v = randn(rows, shapes.num_kv_heads, shapes.head_dim), randn(rows, shapes.num_kv_heads, shapes.head_dim)
        return k, v, k_cache, v_cache, slots
    if op == "rms_norm":
        return randn(rows, shapes.hidden_size), randn(shapes.hidden_size), 1e-5, randn(rows, shapes.hidden_size)
    if op == "apply_rotary":
        q_size, kv_size = shapes.num_heads * shapes.head_dim, shapes.num_kv_heads * shapes.head_dim
        q, k, _ = randn(rows, q_size + 2 * kv_size).split([q_size, kv_size, kv_size], dim=-1)  # views, as in a layer
        angles = torch.rand(rows, shapes.head_dim, generator=generator) * 6.3
        return q.view(rows, -1, shapes.head_dim), k.view(rows, -1, shapes.head_dim), angles.cos(), angles.sin()
    if op == "silu_and_mul":
        return (randn(rows, 2 * shapes.intermediate_size),)
    raise ValueError(f"no timing inputs for {op!r}")


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
    paths: Mapping[str, Callable], inputs: tuple, timer: Callable[[], float] = time.perf_counter
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


def settled_path(mode: str, dtype: torch.dtype, device: torch.device) -> tuple[str, str | None] | None:
    """What runs without measuring: ("torch" or "compiled", None) where `mode` forces it, ("torch",
    why) where the compiled kernels can't run here; None where the two are to be timed. Raises
    ValueError for an unknown mode, or `compiled` forced where it can't run."""
    if mode not in MODES:
        raise ValueError(f"CPU kernel mode must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "torch":
        return "torch", None
    from graphrt.kernels.cpu import extension  # builds the kernels on first use

    reason = extension.unavailable_reason(dtype, device)
    if reason is not None:
        if mode == "compiled":
            raise ValueError(f"{MODE_ENV}=compiled, but the compiled CPU kernels can't run here: {reason}")
        return "torch", f"the compiled kernels can't run here: {reason}"
    return ("compiled", None) if mode == "compiled" else None


def faster(seconds: Mapping[str, float], tie: str = "torch") -> str:
    """The path to keep from time_paths' medians: the other path only where it wins by the margin,
    else `tie`."""
    other = "compiled" if tie == "torch" else "torch"
    return other if seconds[other] < seconds[tie] * (1 - MARGIN) else tie


def choose_greedy_argmax(
    device: torch.device,
    vocab_size: int,
    rows: int,
    mode: ForcedModes | str = "auto",
    timer: Callable[[], float] = time.perf_counter,
    cached: str | None = None,
) -> tuple[Callable, str | None]:
    """The greedy argmax for a sampler on `device` and one line saying which and why (None on CUDA,
    which runs torch's): on a CPU the compiled one or torch's, timed on float32 logits of `rows`
    rows as the ops above are timed, or the one `mode` forces (for `greedy_argmax`), or the one a
    graph cache recorded (`cached`: compiled or torch)."""
    from graphrt.kernels import argmax
    from graphrt.kernels.cpu import elementwise

    mode = as_forced(mode).of("greedy_argmax")
    functions = {"compiled": elementwise.greedy_argmax, "torch": argmax.greedy_argmax}
    if device.type != "cpu":
        return argmax.greedy_argmax, None
    if mode == "auto" and cached in functions and settled_path("auto", torch.float32, device) is None:
        return functions[cached], f"greedy argmax: {cached} (from the graph cache)"
    settled = settled_path(mode, torch.float32, device)
    if settled is not None:
        path, note = settled
        return functions[path], f"greedy argmax: {path} ({note or f'forced by {MODE_ENV}'})"
    logits = torch.randn(rows, vocab_size, generator=torch.Generator().manual_seed(0))
    seconds = time_paths(functions, (logits,), timer)
    path = faster(seconds)
    line = (f"greedy argmax: {path} ({seconds['compiled'] * 1e3:.3f} vs {seconds['torch'] * 1e3:.3f} ms at {rows} "
            f"rows of {vocab_size}, compiled vs torch)")
    return functions[path], line


def choose_cpu_kernels(
    shapes: LayerShapes,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    rows: int,
    mode: ForcedModes | str = "auto",
    timer: Callable[[], float] = time.perf_counter,
    cached: Mapping[str, str] | None = None,
    fused_silu: bool = False,
) -> CpuKernelChoice:
    """The kernels for a CPU stage of these shapes, at `rows` rows (its largest decode bucket): per
    op, the path `mode` forces, else the one `cached` (the graph cache's) gives, else the faster. A
    CUDA stage has no choice: it runs its kernel set's (--kernels).

    `fused_silu`: every gate/up matmul of the stage is in panels that end in silu_and_mul's compiled
    row function (kernels/cpu/linear.py), so the op alone never runs and is not timed: compiled
    (unless forced), which lets a decode step's layers run in one call. Timed alone it lost a
    Qwen3-MoE model that call (0.019 against 0.015 ms at 32 rows), worth 1.25x its decode at 32
    rows and 1.55x at one (benchmarks/results.md)."""
    if device.type != "cpu":
        raise ValueError(f"only a CPU stage chooses its CPU kernels; a {device.type} stage runs its kernel set's")
    modes = as_forced(mode)
    one_call = modes.of("decode_layers") != "off"
    by_op = {op: modes.of(op) for op in OPS}
    if set(by_op.values()) == {"torch"}:
        return CpuKernelChoice.everywhere("torch", "forced", one_call=one_call)
    for op, op_mode in by_op.items():
        settled = settled_path(op_mode, dtype, device)  # raises where `compiled` is forced and can't run here
        if settled is not None and settled[1] is not None:  # the compiled kernels can't run here
            logger.warning("CPU kernels: the torch references, as %s", settled[1])
            return CpuKernelChoice.everywhere("torch", "only", note=settled[1], one_call=one_call)
    settled_how = {op: "forced" for op, op_mode in by_op.items() if op_mode != "auto"}
    if fused_silu and by_op["silu_and_mul"] == "auto":
        by_op["silu_and_mul"], settled_how["silu_and_mul"] = "compiled", "fused"
    for op in OPS:
        if by_op[op] == "auto" and (cached or {}).get(op) in ("torch", "compiled"):
            by_op[op], settled_how[op] = cached[op], "cached"
    timed = [op for op, op_mode in by_op.items() if op_mode == "auto"]
    if not timed:
        source = "cached" if "cached" in settled_how.values() else "forced"
        mixed = len(set(settled_how.values())) > 1
        return CpuKernelChoice(by_op, source, rows=rows, settled=settled_how if mixed else {}, one_call=one_call)
    compiled = compiled_ops()
    seconds = {
        op: time_paths({"compiled": compiled[op], "torch": TORCH_OPS[op]},
                       timing_inputs(op, shapes, rows, block_size, dtype), timer)
        for op in timed
    }
    paths = {op: faster(seconds[op], tie="compiled" if op in DECODE_LAYER_OPS else "torch") if op in seconds else by_op[op]
             for op in OPS}
    return CpuKernelChoice(paths, "measured", seconds, rows, settled=settled_how, one_call=one_call)


def argmax_path(greedy_argmax: Callable) -> str:
    """Which greedy argmax a sampler runs, as a graph cache records it: compiled or torch."""
    from graphrt.kernels.cpu import elementwise

    return "compiled" if greedy_argmax is elementwise.greedy_argmax else "torch"
