"""Start-up handshake: every rank agrees on the model, dtype, buckets and stage layout, or none starts.

Rank 0 decides (it has loaded stage 0, sized the KV cache and chosen the buckets) and sends each
worker a `StagePlan` as one fixed-size int64 tensor. Each worker compares what it was told with
what it sees itself (its model folder's fingerprint, its --dtype and --buckets if given, the stage
layout it computes for the plan's partition rows) and answers with a status; rank 0 sends every worker the verdict, so on a
mismatch every rank stops with the same message naming the field. Then each worker loads its
stage, captures its graphs and reports ready with its weight bytes (graphrt/model/weight_reads.py).
Rank 0 captures stage 0 between the verdict and the wait for ready (`engine_handshake` and
`wait_ready`): under expert parallelism stage 0's other ranks capture with it, collective for collective.
"""

from __future__ import annotations

import dataclasses
import datetime
from dataclasses import dataclass

import torch

from graphrt.config import DTYPES
from graphrt.distributed.transport import Link, StageFailure, stage_name
from graphrt.model.weight_reads import WeightReads

PLAN_SIZE = 192
MAX_BUCKETS = 64
MAX_STAGES = 64
FIELDS = ("ok", "model_fingerprint", "dtype", "pp", "stages", "buckets", "model folder", "ep")
DTYPE_CODES = sorted({str(d).removeprefix("torch.") for d in DTYPES.values()})
KERNEL_CODES = ("auto", "torch", "triton")
READS_SIZE = len(dataclasses.fields(WeightReads))  # a worker reports ready with one of these, field by field


@dataclass
class StagePlan:
    """What rank 0 decided for every stage."""

    fingerprint: str  # capture.manifest.model_fingerprint (sha256 hex)
    dtype: str
    pp: int
    layers: list[range]  # per stage
    partition_rows: int  # the decode rows the partition weighed a mixture of experts at (Engine._partition_rows)
    buckets: list[int]
    num_blocks: int
    block_size: int
    max_model_len: int
    num_slots: int
    max_tokens: int  # per micro-batch
    seed: int
    use_cuda_graphs: bool
    kernels: str
    allow_eager: bool
    ep: int = 1  # ranks per stage, which split each sparse layer's routed experts
    timeline: bool = False  # every rank records its slices of stage work (graphrt.profiling.timeline)

    def encode(self) -> torch.Tensor:
        if len(self.buckets) > MAX_BUCKETS or self.pp > MAX_STAGES:
            raise ValueError(f"--procs supports at most {MAX_BUCKETS} buckets and {MAX_STAGES} stages")
        values = list(torch.frombuffer(bytearray(bytes.fromhex(self.fingerprint)), dtype=torch.int64).tolist())
        values += [DTYPE_CODES.index(self.dtype), self.pp, self.num_blocks, self.block_size, self.max_model_len]
        values += [self.num_slots, self.max_tokens, self.seed, int(self.use_cuda_graphs), KERNEL_CODES.index(self.kernels)]
        values += [int(self.allow_eager), self.partition_rows, self.ep, int(self.timeline), len(self.buckets)]
        values += self.buckets + [0] * (MAX_BUCKETS - len(self.buckets))
        values += [r.start for r in self.layers] + [self.layers[-1].stop]
        return torch.tensor(values + [0] * (PLAN_SIZE - len(values)), dtype=torch.int64)

    @staticmethod
    def decode(tensor: torch.Tensor) -> StagePlan:
        values = tensor.tolist()
        fingerprint = tensor[:4].numpy().tobytes().hex()
        dtype, pp, num_blocks, block_size, max_model_len, num_slots, max_tokens, seed, graphs, kernels, eager = values[4:15]
        partition_rows, ep, timeline, num_buckets = values[15:19]
        buckets = values[19 : 19 + num_buckets]
        bounds = values[19 + MAX_BUCKETS : 19 + MAX_BUCKETS + pp + 1]
        return StagePlan(
            fingerprint, DTYPE_CODES[dtype], pp, [range(a, b) for a, b in zip(bounds, bounds[1:])], partition_rows, buckets,
            num_blocks, block_size, max_model_len, num_slots, max_tokens, seed, bool(graphs), KERNEL_CODES[kernels], bool(eager), ep,
            bool(timeline),
        )


@dataclass
class WorkerView:
    """What a worker sees for itself; None means "take rank 0's"."""

    fingerprint: str
    layers: list[range]
    pp: int
    dtype: str | None = None
    buckets: list[int] | None = None
    ep: int = 1


def first_difference(plan: StagePlan, view: WorkerView) -> tuple[str, str, str] | None:
    """(field, rank 0's value, this rank's value) of the first disagreement, or None."""
    checks = [
        ("model_fingerprint", plan.fingerprint[:16], view.fingerprint[:16]),
        ("dtype", plan.dtype, view.dtype or plan.dtype),
        ("ep", plan.ep, view.ep),
        ("pp", plan.pp, view.pp),
        ("stages", [(r.start, r.stop) for r in plan.layers], [(r.start, r.stop) for r in view.layers]),
        ("buckets", plan.buckets, view.buckets or plan.buckets),
    ]
    return next(((name, str(ours), str(theirs)) for name, ours, theirs in checks if ours != theirs), None)


def mismatch_message(rank: int, field: str, ep: int) -> str:
    return (
        f"{stage_name(rank, ep)} disagrees with the engine about {field}; start every rank with the same "
        "--model folder (same files), --dtype, --buckets, --pp and --ep"
    )


def engine_handshake(link: Link, plan: StagePlan, timeout_s: float) -> None:
    """Rank 0: send the plan, collect statuses, send the verdict. Raises StageFailure naming the
    field and the first rank that disagreed."""
    timeout = datetime.timedelta(seconds=timeout_s)
    encoded = plan.encode()
    for rank in range(1, link.world_size):
        link.send([encoded], rank)
    statuses = [link.recv(torch.zeros(2, dtype=torch.int64), rank, timeout).tolist() for rank in range(1, link.world_size)]
    bad = next(((rank, code) for rank, (code, _) in enumerate(statuses, start=1) if code), (-1, 0))
    for rank in range(1, link.world_size):
        link.send([torch.tensor(bad, dtype=torch.int64)], rank)
    if bad[0] != -1:
        raise StageFailure(mismatch_message(bad[0], FIELDS[bad[1]], link.ep))


def wait_ready(link: Link, timeout_s: float) -> list[WeightReads]:
    """Rank 0: wait for every worker to load and capture its stage. Returns each worker's weight
    bytes (ranks 1..), as a decode step reads them."""
    timeout = datetime.timedelta(seconds=timeout_s)
    weight_reads = []
    for rank in range(1, link.world_size):
        failed, *reads = link.recv(torch.zeros(1 + READS_SIZE, dtype=torch.int64), rank, timeout).tolist()
        if failed:
            raise StageFailure(f"{link.name(rank)} could not load its stage; its own output says why")
        weight_reads.append(WeightReads(*reads))
    return weight_reads


def worker_handshake(link: Link, view_of, timeout_s: float) -> StagePlan:
    """A worker: receive the plan, compare it with `view_of(plan)` (a WorkerView, or an exception
    when this rank can't even read its model), report, and learn the verdict."""
    timeout = datetime.timedelta(seconds=timeout_s)
    plan = StagePlan.decode(link.recv(torch.zeros(PLAN_SIZE, dtype=torch.int64), 0, timeout))
    try:
        difference = first_difference(plan, view_of(plan))
        code = FIELDS.index(difference[0]) if difference else 0
        detail = f"the engine has {difference[1]}, this rank {difference[2]}" if difference else ""
    except Exception as exc:  # noqa: BLE001 - reported to every rank, then raised here
        code, detail = FIELDS.index("model folder"), str(exc)
    link.send([torch.tensor([code, 0], dtype=torch.int64)], 0)
    bad_rank, bad_code = link.recv(torch.zeros(2, dtype=torch.int64), 0, timeout).tolist()
    if bad_rank != -1:
        extra = f" ({detail})" if bad_rank == link.rank and detail else ""
        raise StageFailure(mismatch_message(bad_rank, FIELDS[bad_code], link.ep) + extra)
    return plan


def report_ready(link: Link, weight_reads: WeightReads | None, timeout_s: float) -> None:
    """A worker: its stage is loaded and captured (its weight bytes, as a decode step reads them), or
    failed to (None). Rank 0 may still be capturing its own stage: the send waits up to `timeout_s`."""
    values = [int(weight_reads is None), *dataclasses.astuple(weight_reads or WeightReads(0))]
    link.send([torch.tensor(values, dtype=torch.int64)], 0, timeout=datetime.timedelta(seconds=timeout_s))
