"""Each CPU matmul's path, chosen by timing the candidates on this machine.

A CPU stage can run a matmul three ways (kernels/cpu/linear.py): `F.linear` on the weight as loaded
("dense": MKL's sgemm for float32; oneDNN for bfloat16, on AMX tiles where the CPU has them),
oneDNN on the weight reordered once into its blocked layout ("packed"), or graphrt's compiled
kernel on the weight cut into panels of 16 columns ("panel", AVX-512 CPUs). Which is fastest
depends on the CPU, the shape and the rows: on the 2-core AMD EPYC build machine packed beats
F.linear on every float32 shape by 1.1 to 2.5x and panel beats packed by 1.15 to 2.6x at one row,
while on an Intel machine plain `F.linear` streams float32 faster at one row than packed. So a
stage times every path it has on its own weights, at one row and at its largest decode bucket, and
keeps the fastest for each weight shape (each layer's q/k/v, o, gate/up and down, and the LM head).
A mixture of experts' routed experts are two shapes more (each expert's gate/up and down), timed at
one row and at the rows one expert gets on average in the largest bucket (32 rows at top-2 of 16
experts: 4), since each expert runs on the rows that chose it (kernels/cpu/moe.py).

What keeps the timing honest:
- Each timing run sweeps several layers' weights, at least the L3 cache's size in all, and the
  paths alternate, so each matmul reads its weight from memory as a decode step does, not from a
  cache that holds it (that flatters the small shapes: 4x for float32 q/k/v at one row).
- Paths and row counts are interleaved round by round, so load elsewhere on the machine slows them
  alike, and each keeps the median of all its calls (each matmul timed on its own: one stalled
  by another process then moves the median, not a whole sweep). No test asserts a winner.
- A weight is kept in one form (two would double its memory), so a shape's path must serve one row
  and a full batch: each path scores its time over the fastest at each row count, summed, so both
  regimes weigh the same; another path must beat `F.linear` by MARGIN, so noise does not flip a tie,
  and within MARGIN of the fastest the compiled panels win: they let a decode step's gate/up end in
  SiLU-and-mul and its layers run in one call (graphrt::decode_layers), worth more than a tie.
- Timing holds the swept weights in every candidate form at once: for a shape of one weight (the
  LM head) that is two copies beside the dense one while it is timed.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Hashable, Mapping

import torch

from graphrt.kernels.cpu.forcing import ForcedModes
from graphrt.kernels.cpu.forcing import mode_from_env as env_mode
from graphrt.kernels.cpu.info import cpu_l3_bytes
from graphrt.kernels.cpu.linear import can_pack, can_use_panels, convert, linear

PATH_NAMES = {"dense": "F.linear", "packed": "packed oneDNN", "panel": "compiled panels"}  # dense, the reference, first
MODES = ("auto", *PATH_NAMES)
MODE_ENV = "GRAPHRT_MATMUL"  # forces paths, for every shape or by name (tests, benchmarks); auto (measure) by default
SHAPE_NAMES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")  # a stage's weight shapes
# A sparse layer's routed experts, one weight of each shape per expert (kernels/cpu/moe.py), timed
# at the rows an expert gets rather than the batch's.
EXPERT_NAMES = ("experts_gate_up", "experts_down")

# Timing one weight shape: rounds until SHAPE_BUDGET_S is spent and every path and row count has
# MIN_SAMPLES calls timed, never past SHAPE_LIMIT_S. For the default model 0.45 to 0.95 s in all,
# packing included; on a busy machine the limit keeps it near 5 x SHAPE_LIMIT_S.
MIN_SAMPLES, MAX_ROUNDS = 5, 5
SHAPE_BUDGET_S, SHAPE_LIMIT_S = 0.1, 0.3
MARGIN = 0.03
# A path this many times slower than the fastest at every row count after a round is all but out
# of the running (its score is over twice the least possible): it is not timed again, which spares
# the slowest calls, and keeps the median it has.
FAR_BEHIND = 2.0


def mode_from_env(environ: Mapping[str, str] = os.environ) -> ForcedModes:
    """GRAPHRT_MATMUL: a path for every shape (`packed`), or by shape name (`o_proj=panel,packed`:
    o_proj in panels, the others packed; `o_proj=panel`: the others measured)."""
    return env_mode(MODE_ENV, MODES, environ, {name: MODES for name in (*SHAPE_NAMES, *EXPERT_NAMES)})


@dataclass(frozen=True)
class MatmulChoice:
    """The path one weight shape of a stage runs on, and why."""

    name: str  # qkv_proj, o_proj, gate_up_proj, down_proj, lm_head
    shape: tuple[int, int]  # (out_features, in_features)
    path: str  # dense | packed | panel
    # measured | cached (the graph cache) | forced (GRAPHRT_MATMUL) | unavailable (the forced path
    # can't run this shape here: F.linear instead) | only (no other path for this device and dtype)
    source: str
    seconds: dict[str, dict[int, float]] = field(default_factory=dict)  # path -> rows -> median s per matmul

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "shape": list(self.shape),
            "path": self.path,
            "seconds": {path: {str(rows): s for rows, s in by_rows.items()} for path, by_rows in self.seconds.items()},
        }

    @staticmethod
    def from_json(raw: dict) -> MatmulChoice:
        """A choice a graph cache recorded; raises ValueError if it is malformed."""
        try:
            choice = MatmulChoice(
                name=str(raw["name"]),
                shape=(int(raw["shape"][0]), int(raw["shape"][1])),
                path=str(raw["path"]),
                source="cached",
                seconds={p: {int(r): float(s) for r, s in by_rows.items()} for p, by_rows in raw.get("seconds", {}).items()},
            )
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"a matmul choice in the graph cache is malformed ({exc!r}): {raw!r}") from None
        if choice.path not in PATH_NAMES:
            raise ValueError(f"a matmul choice in the graph cache names the path {choice.path!r}, not one of {list(PATH_NAMES)}")
        return choice


@dataclass(frozen=True)
class MatmulPlan:
    """One stage's choices, the row counts they were timed at (the routed experts' apart), and the
    seconds measuring took."""

    choices: tuple[MatmulChoice, ...]
    rows: tuple[int, ...]
    measure_s: float = 0.0
    expert_rows: tuple[int, ...] = ()  # empty for a stage without routed experts

    def path(self, name: str) -> str:
        return next(c.path for c in self.choices if c.name == name)

    def by_name(self) -> dict[str, MatmulChoice]:
        return {c.name: c for c in self.choices}

    def to_json(self) -> dict:
        return {
            "rows": list(self.rows), "expert_rows": list(self.expert_rows), "measure_s": round(self.measure_s, 4),
            "choices": [c.to_json() for c in self.choices],
        }

    @staticmethod
    def from_json(raw: dict) -> MatmulPlan:
        try:
            choices = tuple(MatmulChoice.from_json(c) for c in raw["choices"])
            rows = tuple(int(r) for r in raw["rows"])
            expert_rows = tuple(int(r) for r in raw.get("expert_rows", []))  # none in a cache from before the experts were chosen
            return MatmulPlan(choices, rows, expert_rows=expert_rows)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"the graph cache's matmul plan is malformed ({exc})") from None

    def summary(self) -> str:
        return summarize([self])


def summarize(plans: list[MatmulPlan]) -> str:
    """One line for a start-up banner, e.g. "matmuls: packed oneDNN for qkv_proj, gate_up_proj;
    F.linear for o_proj, down_proj, lm_head (measured at 1 and 32 rows in 0.41 s)"; a stage with
    routed experts adds the rows they were timed at ("1 and 32 rows, experts at 1 and 4,").

    A shape whose path differs between stages is named once per stage (o_proj@1)."""
    paths_of: dict[str, set[str]] = {}
    for plan in plans:
        for c in plan.choices:
            paths_of.setdefault(c.name, set()).add(c.path)
    names: dict[str, list[str]] = {path: [] for path in PATH_NAMES}
    for stage, plan in enumerate(plans):
        for c in plan.choices:
            label = c.name if len(paths_of[c.name]) == 1 else f"{c.name}@{stage}"
            if label not in names[c.path]:
                names[c.path].append(label)
    if not any(names.values()):
        return "matmuls: none on this stage"
    parts = [f"{PATH_NAMES[path]} for {', '.join(labels)}" for path, labels in names.items() if labels]
    sources = {c.source for plan in plans for c in plan.choices}
    why = []
    if "measured" in sources:
        rows = sorted({r for plan in plans for r in plan.rows})
        expert_rows = sorted({r for plan in plans for r in plan.expert_rows})
        experts = f", experts at {' and '.join(map(str, expert_rows))}," if expert_rows else ""
        why.append(f"measured at {' and '.join(map(str, rows))} rows{experts} in {sum(p.measure_s for p in plans):.2f} s")
    if "cached" in sources:
        why.append("from the graph cache")
    if "forced" in sources:
        why.append(f"forced by {MODE_ENV}")
    if "unavailable" in sources:
        why.append(f"F.linear where {MODE_ENV}'s path can't run here")
    if "only" in sources:
        why.append("F.linear is the only path for this device and dtype" if len(sources) == 1 else "some have one path")
    return f"matmuls: {'; '.join(parts)} ({'; '.join(why)})"


def median_seconds(
    runs: Mapping[Hashable, Callable[[float], list[float]]],
    timer: Callable[[], float] = time.perf_counter,
    min_samples: int = MIN_SAMPLES,
    max_rounds: int = MAX_ROUNDS,
    budget_s: float = SHAPE_BUDGET_S,
    limit_s: float = SHAPE_LIMIT_S,
    losing: Callable[[dict[Hashable, float]], set[Hashable]] = lambda medians: set(),
) -> dict[Hashable, float]:
    """Per run, the median of the seconds its calls took, over all rounds.

    Runs are interleaved round by round (in the order given); each is given the `timer` value at
    which the `limit_s` is spent, makes at least one call and stops there, and returns each call's
    seconds. After each round, the runs `losing` names (given every run's median so far) are not
    run again; they keep the median they have. Rounds stop once `budget_s` is spent and every run
    still going has `min_samples` calls, at the limit in any case (a busy machine then gets fewer
    samples, not a slower start), or after `max_rounds`."""
    samples: dict[Hashable, list[float]] = {key: [] for key in runs}
    going = dict(runs)
    start = timer()
    for _ in range(max_rounds):
        for key, run in going.items():
            samples[key] += run(start + limit_s)
        for key in losing({key: statistics.median(values) for key, values in samples.items()}):
            going.pop(key, None)
        spent = timer() - start
        if not going or spent >= limit_s or (spent >= budget_s and min(len(samples[key]) for key in going) >= min_samples):
            break
    return {key: statistics.median(values) for key, values in samples.items()}


def pick_path(seconds: Mapping[str, Mapping[int, float]], margin: float = MARGIN) -> str:
    """The path with the lowest time relative to the fastest at each row count, summed over the row
    counts, panel where it is within `margin` of that; a path other than dense must beat dense's
    score by `margin`."""
    rows = sorted(next(iter(seconds.values())))
    best = {r: max(min(by_rows[r] for by_rows in seconds.values()), 1e-12) for r in rows}
    score = {path: sum(by_rows[r] / best[r] for r in rows) for path, by_rows in seconds.items()}
    fastest = min(score, key=score.get)
    if "panel" in score and score["panel"] * (1 - margin) <= score[fastest]:
        fastest = "panel"
    if "dense" in score and fastest != "dense" and score[fastest] > score["dense"] * (1 - margin):
        return "dense"
    return fastest


def sweep_length(weight_bytes: int, num_weights: int, sweep_bytes: int) -> int:
    """How many of a shape's weights one timed call reads: `sweep_bytes` worth, at least one."""
    return max(1, min(num_weights, -(-sweep_bytes // weight_bytes)))


def available_paths(device: torch.device, dtype: torch.dtype, shape: tuple[int, int], mode: str = "auto") -> tuple[str, ...]:
    """The paths a weight of `shape` can take on `device` in `dtype`: dense always, then the others
    this torch and CPU run; with a forced `mode`, only that one is looked for (finding out whether
    the panel kernel runs may mean building it)."""
    checks = {"packed": lambda: can_pack(device, dtype), "panel": lambda: can_use_panels(device, dtype, shape)}
    return ("dense", *(path for path, can in checks.items() if mode in ("auto", path) and can()))


def far_behind(medians: Mapping[tuple[str, int], float]) -> set[tuple[str, int]]:
    """Of runs keyed (path, rows), those of the paths more than FAR_BEHIND times the fastest path's
    time at every row count."""
    paths, rows = {path for path, _ in medians}, {r for _, r in medians}
    best = {r: min(medians[path, r] for path in paths) for r in rows}
    behind = {path for path in paths if all(medians[path, r] > FAR_BEHIND * best[r] for r in rows)}
    return {(path, r) for path, r in medians if path in behind}


def time_paths(
    paths: Mapping[str, list[torch.Tensor]], rows: tuple[int, ...], timer: Callable[[], float] = time.perf_counter
) -> dict[str, dict[int, float]]:
    """Median seconds per matmul of each path at each row count. A run sweeps all of a path's
    weights (the same weights in each path's form), timing each matmul: on a busy machine the
    median call is one the other processes left alone, where the median sweep of 30 calls may not be."""
    dense = paths["dense"]
    in_features = dense[0].shape[1]
    inputs = {r: torch.randn(r, in_features, dtype=dense[0].dtype, device=dense[0].device) for r in rows}
    for weights in paths.values():  # oneDNN builds its primitive for a shape and row count on the first call
        for x in inputs.values():
            linear(x, weights[0])

    def sweep(weights: list[torch.Tensor], x: torch.Tensor) -> Callable[[float], list[float]]:
        def run(stop_at: float) -> list[float]:
            seconds = []
            for weight in weights:
                began = timer()
                linear(x, weight)
                ended = timer()
                seconds.append(ended - began)
                if ended >= stop_at:
                    break
            return seconds

        return run

    # Paths alternate, so each sweep follows one over other memory and finds none of its weights cached.
    runs = {(path, r): sweep(weights, inputs[r]) for r in rows for path, weights in paths.items()}
    medians = median_seconds(runs, timer, losing=far_behind)
    return {path: {r: medians[path, r] for r in rows} for path in paths}


def choose_path(
    name: str,
    weights: list[torch.Tensor],
    rows: tuple[int, ...],
    mode: str,
    paths: tuple[str, ...],
    previous: MatmulChoice | None = None,
    timer: Callable[[], float] = time.perf_counter,
) -> tuple[MatmulChoice, list[torch.Tensor]]:
    """The path for the weights of one shape (one per layer, dense), of the `paths` available to
    it (`available_paths`), and the copies in that path's form made while timing (the first few
    weights; empty if dense won): reuse them when converting.

    A forced `mode` comes first (F.linear where this shape can't take it here), then a `previous`
    choice for the same shape (the graph cache's, or another stage's on the same device), then a
    measurement."""
    shape = (int(weights[0].shape[0]), int(weights[0].shape[1]))
    if mode != "auto":
        return MatmulChoice(name, shape, mode, "forced") if mode in paths else MatmulChoice(name, shape, "dense", "unavailable"), []
    if len(paths) == 1:
        return MatmulChoice(name, shape, "dense", "only"), []
    if previous is not None and previous.shape == shape and previous.path in paths:
        return replace(previous, name=name), []
    sweep = weights[: sweep_length(weights[0].numel() * weights[0].element_size(), len(weights), cpu_l3_bytes())]
    trials = {path: [convert(path, w) for w in sweep] for path in paths}
    seconds = time_paths(trials, rows, timer)
    path = pick_path(seconds)
    return MatmulChoice(name, shape, path, "measured", seconds), trials[path] if path != "dense" else []


def measure_shapes(
    shapes: Mapping[str, tuple[int, int, int]], dtype: torch.dtype, rows: tuple[int, ...], timer: Callable[[], float] = time.perf_counter
) -> MatmulPlan:
    """The choice a CPU stage would make for weights of these shapes, name -> (out_features,
    in_features, how many), on random weights (what `graphrt doctor` and benchmarks show without
    loading a model). Only the weights one timing run sweeps are made, and making them is not
    counted in the plan's seconds."""
    choices, measure_s = [], 0.0
    for name, (out_features, in_features, count) in shapes.items():
        weight_bytes = out_features * in_features * torch.empty(0, dtype=dtype).element_size()
        num_weights = sweep_length(weight_bytes, count, cpu_l3_bytes())
        weights = [torch.empty(out_features, in_features, dtype=dtype).uniform_(-0.05, 0.05) for _ in range(num_weights)]
        paths = available_paths(torch.device("cpu"), dtype, (out_features, in_features))
        start = timer()
        choices.append(choose_path(name, weights, rows, "auto", paths, timer=timer)[0])
        measure_s += timer() - start
    return MatmulPlan(tuple(choices), rows, measure_s)
