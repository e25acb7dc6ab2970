"""The wire between stage processes: fixed-layout tensors over a torch.distributed process group.

A micro-batch travels from rank k to rank k+1 as
  header    int64 (HEADER_SIZE,): kind, micro-batch id, slot, rows, tokens, bucket, block-table
            width, sampled rows, released request ids, stage counters, logits rows, scored sampled
            rows, scored prompt rows, logprob alternatives + 1 (0: no logprobs), the logits plan's
            ints and floats (0: no plan)
  ints      int64: positions, slot mapping, block tables, seq lens, logits rows, query lens
            (prefill), then for sampling: sampled rows, request ids, top_k, seeds, has-seed,
            then the request ids whose generators and token histories can go, then each rank's stage counters (`counter_width`
            of them: the microseconds the stage so far has worked in all, then for a mixture of
            experts the tokens it routed to each expert; filled in as the micro-batch passes),
            then for logprobs (graphrt.runtime.logprobs): the scored sampled rows, the scored prompt tokens,
            then the logits plan's ints (graphrt.runtime.logits_plan: LogitsPlan.to_wire)
  floats    float64 (2 * sampled rows): temperature, top_p, then the plan's floats   (only when rows are sampled)
  hidden    (tokens, hidden_size) in the stage dtype, into the receiver's per-slot buffer (k > 0)
and the last rank answers rank 0 with a reply header (REPLY_SIZE,) followed by the token ids, the
stage counters, from which rank 0 reports every stage's busy time and expert load, and any logprobs (float32
values: each row's logprob, its rank, its alternatives'; int64 alternatives' ids).
Nothing is pickled, so every rank reads the same bytes the same way, and gloo (CPU) and NCCL (GPU,
device tensors) carry it alike. Every wait is bounded by the watchdog, so a dead or silent peer
becomes an error naming its stage instead of a hang.

Under expert parallelism (--ep E) each stage is E ranks, stage-major: rank r runs stage r // E
as expert rank r % E. Expert rank 0 of a stage (its leader) talks to the neighbouring stages as
above, and first passes each message, unchanged but without what only the last stage needs, to
its stage's other ranks (stage 0's get the token ids in place of hidden states); those run the
stage and pass nothing on. The ranks of a stage sum their experts' shares on a third group of
their own (`Link.combine_experts`). Each rank's own figures (`RankStats`: busy time, time in those
all-reduces, tokens its experts served) go through the rendezvous store, off the micro-batches' path.
"""

from __future__ import annotations

import datetime
import json
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from graphrt.errors import GraphrtError
from graphrt.kernels.cpu.matmul_choice import MatmulPlan
from graphrt.kernels.cpu.placement import usable_cores
from graphrt.model.batch import StepMetadata
from graphrt.model.config import ModelConfig
from graphrt.runtime.logits_plan import LogitsPlan
from graphrt.runtime.stage_builder import StageKernels
from graphrt.sampling_params import SamplingParams

HEADER_SIZE = 16
REPLY_SIZE = 7
PREFILL, DECODE, HEARTBEAT, SHUTDOWN = 0, 1, 2, 3
STATS_INTERVAL_S = 0.5  # under expert parallelism, how often a rank publishes its figures (RankStats), and rank 0 reads them


class StageFailure(GraphrtError):
    """A stage process died, stopped answering, or was refused at start-up."""


def cpu_threads_per_stage(world_size: int, num_cores: int | None = None) -> int:
    """Stages on one CPU share its cores (`num_cores`, by default those this process may use: a
    taskset mask or a pinned engine process, not the machine's); more threads than cores make
    every op wait on the others."""
    return max(1, (num_cores or len(usable_cores())) // world_size)


def counter_width(cfg: ModelConfig) -> int:
    """Each stage's counters: its busy microseconds, then a mixture of experts' experts read by decode
    steps (Stage.seen_expert_reads) and tokens per expert."""
    return 1 + (1 + cfg.moe.num_experts if cfg.moe is not None else 0)


def stage_name(rank: int, ep: int = 1) -> str:
    stage, expert_rank = divmod(rank, ep)
    if rank == 0:
        return "stage 0 (the engine, rank 0)"
    return f"stage {stage} (rank {rank})" if ep == 1 else f"stage {stage} expert rank {expert_rank} (rank {rank})"


@dataclass
class Sampling:
    """What the last stage needs to sample a micro-batch's rows as the single-process engine would."""

    rows: list[int]  # rows of the micro-batch that get a token
    request_ids: list[int]
    params: list[SamplingParams]
    seeds: list[int | None]
    released: list[int]  # request ids whose seeded generators and token histories are no longer needed
    # Logprobs (graphrt.runtime.logprobs.LogprobPlan, without what only rank 0 needs): num_top < 0 is none.
    scored: list[int] = field(default_factory=list)
    prompt_targets: list[int] = field(default_factory=list)
    num_top: int = -1
    logits_plan: LogitsPlan | None = None  # penalties, bias, masks, min_p of the rows that ask


@dataclass
class Message:
    """One micro-batch as a stage receives it."""

    kind: int
    micro_batch: int
    slot: int
    meta: StepMetadata | None = None
    bucket: int | None = None
    sampling: Sampling | None = None
    hidden: torch.Tensor | None = None  # (tokens, hidden_size), a view into the slot's buffer
    counters: list[int] | None = None  # per stage, `counter_width` of them (see the module docstring)

    def for_expert_ranks(self) -> Message:
        """What a stage's leader passes its other expert ranks: the step, not the sampling."""
        return Message(self.kind, self.micro_batch, self.slot, self.meta, self.bucket, hidden=self.hidden)


@dataclass(frozen=True)
class RankStats:
    """One rank's figures under expert parallelism, as it last published them (/metrics, profile)."""

    busy_s: float = 0.0  # running micro-batches
    combine_s: float = 0.0  # waiting in its sparse layers' all-reduces (gloo only: on NCCL the graph holds them)
    expert_tokens: int = 0  # tokens routed to its experts, one per sparse layer and choice


class Link:
    """Point-to-point sends and receives with a deadline. Micro-batches go down the stages on one
    process group, tokens come back to rank 0 on another: with pp = 2 both directions join the same
    two ranks, and on NCCL one communicator's send would queue behind its own pending receive. With
    expert parallelism a third group joins the ranks of this rank's stage (None without)."""

    def __init__(
        self, groups: tuple, rank: int, world_size: int, device: torch.device, timeout_s: float, ep: int = 1,
        startup_timeout_s: float = 0.0,
    ):
        (self.group, self.reply_group, self._make_group, self.store), self.rank, self.world_size = groups, rank, world_size
        self.ep = ep
        self.expert_group = None  # join_expert_group, once the handshake has agreed on ep
        self.combine_s = 0.0  # seconds this rank has waited in combine_experts (gloo), since `started`
        self.device = device  # where tensors must live to travel (cuda with NCCL)
        self.timeout = datetime.timedelta(seconds=timeout_s)
        # Until every rank has loaded and captured (`started`), a collective may wait on a rank still
        # loading: it waits as long as start-up may take.
        self.collective_timeout = max(self.timeout, datetime.timedelta(seconds=startup_timeout_s))

    @property
    def pp(self) -> int:
        return self.world_size // self.ep

    @property
    def stage(self) -> int:
        return self.rank // self.ep

    @property
    def expert_rank(self) -> int:
        return self.rank % self.ep

    def leader(self, stage: int) -> int:
        """The rank that talks to the stages around `stage` (its expert rank 0)."""
        return stage * self.ep

    @property
    def expert_peers(self) -> list[int]:
        """A leader's other expert ranks, to which it passes each message ([] for the others)."""
        return [self.rank + e for e in range(1, self.ep)] if self.expert_rank == 0 else []

    def name(self, rank: int) -> str:
        return stage_name(rank, self.ep)

    def started(self) -> None:
        """Every rank is up: from now on a collective waits at most the watchdog, and its time counts."""
        self.collective_timeout, self.combine_s = self.timeout, 0.0

    def publish_kernels(self, kernels: StageKernels) -> None:
        """This rank's kernel choices (its matmul forms and CPU op paths), under its rank; a stage
        leader's under its stage too, for its other expert ranks to run: chosen by timing, two ranks
        could otherwise run the replicated work differently, round differently, and route a near tie
        to different experts."""
        chosen = json.dumps({"matmuls": kernels.matmuls.to_json(), "ops": kernels.cpu.to_json() if kernels.cpu is not None else None})
        self.store.set(f"kernels/rank-{self.rank}", chosen)
        if self.expert_rank == 0:
            self.store.set(f"kernels/stage-{self.stage}", chosen)

    def leader_kernels(self) -> tuple[MatmulPlan, dict[str, str] | None]:
        """What this rank's stage leader chose (waiting for it, up to the start-up timeout)."""
        chosen = json.loads(self.store.get(f"kernels/stage-{self.stage}"))
        return MatmulPlan.from_json(chosen["matmuls"]), chosen["ops"]

    def join_expert_group(self) -> None:
        """Under expert parallelism, meet this stage's other ranks on a group of their own. After the
        handshake: a rank that disagrees about ep would leave the others waiting here, unnamed."""
        if self.ep > 1:
            self.expert_group = self._make_group(f"experts-of-stage-{self.stage}", self.expert_rank, self.ep)

    def combine_experts(self, shares: torch.Tensor) -> None:
        """Sum, in place, each expert rank's share of a sparse layer's output across this stage's
        ranks (one all-reduce). On NCCL it is queued on the stream (a graph holds it); on gloo it
        waits at most the watchdog, and a rank that died or went silent fails the step, naming the stage."""
        if self.device.type == "cuda":
            self.expert_group.allreduce([shares]).wait()
            return
        since = time.perf_counter()
        try:
            self.expert_group.allreduce([shares]).wait(self.collective_timeout)
        except RuntimeError as exc:
            first = self.leader(self.stage)
            reason = "timed out" if "imed out" in str(exc) or "timeout" in str(exc) else "lost the connection"
            raise StageFailure(
                f"the expert ranks of stage {self.stage} (ranks {first}-{first + self.ep - 1}) stopped summing their "
                f"experts' shares: the all-reduce {reason} ({str(exc).splitlines()[0][:160]})"
            ) from None
        self.combine_s += time.perf_counter() - since

    def publish_stats(self, stats: RankStats) -> None:
        """This rank's figures, for rank 0 to read (`read_stats`) when it reports."""
        self.store.set(f"rank-stats/{self.rank}", json.dumps([stats.busy_s, stats.combine_s, stats.expert_tokens]))

    def read_stats(self, rank: int) -> RankStats:
        """What `rank` last published (zeros before it first did)."""
        key = f"rank-stats/{rank}"
        return RankStats(*json.loads(self.store.get(key))) if self.store.check([key]) else RankStats()

    def publish_slices(self, chunk: int, wall_slices: list[dict]) -> None:
        """With the timeline on, this rank's newest finished slices (Timeline.wall_slices), as chunk
        number `chunk` of those it has published."""
        self.store.set(f"timeline/{self.rank}/{chunk}", json.dumps(wall_slices))
        self.store.set(f"timeline/{self.rank}/chunks", str(chunk + 1))

    def read_slices(self, rank: int, first_chunk: int = 0) -> tuple[list[dict], int]:
        """The slices `rank` has published in its chunks from `first_chunk` on, and how many chunks
        it has published in all (where the next read starts)."""
        key = f"timeline/{rank}/chunks"
        chunks = int(self.store.get(key)) if self.store.check([key]) else 0
        slices = [piece for chunk in range(first_chunk, chunks) for piece in json.loads(self.store.get(f"timeline/{rank}/{chunk}"))]
        return slices, chunks

    def send(
        self, tensors: list[torch.Tensor], dst: int, reply: bool = False, timeout: datetime.timedelta | None = None
    ) -> None:
        group = self.reply_group if reply else self.group
        try:
            works = [group.send([t.to(self.device).contiguous()], dst, 0) for t in tensors]
        except RuntimeError as exc:  # gloo refuses at once a peer it already knows is gone
            raise self._failure(dst, "send to", "lost the connection", exc, timeout) from None
        for work in works:
            self._wait(work, dst, "send to", timeout)

    def recv(
        self, tensor: torch.Tensor, src: int, timeout: datetime.timedelta | None = None, reply: bool = False
    ) -> torch.Tensor:
        """Receive into `tensor` (on the link's device; copied back if `tensor` lives elsewhere)."""
        target = tensor if tensor.device == self.device else torch.empty_like(tensor, device=self.device)
        group = self.reply_group if reply else self.group
        try:
            work = group.recv([target], src, 0)
        except RuntimeError as exc:
            raise self._failure(src, "receive from", "lost the connection", exc, timeout) from None
        self._wait(work, src, "receive from", timeout)
        if target is not tensor:
            tensor.copy_(target)
        return tensor

    def _wait(self, work, peer: int, what: str, timeout: datetime.timedelta | None = None) -> None:
        try:
            work.wait(timeout or self.timeout)
        except RuntimeError as exc:
            reason = "timed out" if "imed out" in str(exc) or "timeout" in str(exc) else "lost the connection"
            raise self._failure(peer, what, reason, exc, timeout) from None

    def _failure(self, peer: int, what: str, reason: str, exc: Exception, timeout: datetime.timedelta | None) -> StageFailure:
        return StageFailure(
            f"{self.name(peer)} stopped answering: {what} it {reason} after at most "
            f"{(timeout or self.timeout).total_seconds():g} s ({str(exc).splitlines()[0][:160]})"
        )


def encode(message: Message) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """header, ints, floats (None when no row is sampled) for a micro-batch message."""
    header = torch.zeros(HEADER_SIZE, dtype=torch.int64)
    header[:3] = torch.tensor([message.kind, message.micro_batch, message.slot])
    if message.meta is None:
        return header, torch.zeros(0, dtype=torch.int64), None
    meta, sampling = message.meta, message.sampling
    rows, width = meta.block_tables.shape
    num_tokens = meta.positions.shape[0]
    num_sampled = len(sampling.rows) if sampling else 0
    released = sampling.released if sampling else []
    busy = message.counters or []
    scored, prompt_targets = (sampling.scored, sampling.prompt_targets) if sampling else ([], [])
    logprobs_width = sampling.num_top + 1 if sampling else 0
    plan_ints, plan_floats = sampling.logits_plan.to_wire() if sampling and sampling.logits_plan else ([], [])
    header[3:16] = torch.tensor([
        rows, num_tokens, message.bucket or 0, width, num_sampled, len(released), len(busy),
        meta.logits_indices.shape[0], len(scored), len(prompt_targets), logprobs_width, len(plan_ints), len(plan_floats),
    ])
    parts = [meta.positions, meta.slot_mapping, meta.block_tables.reshape(-1), meta.seq_lens, meta.logits_indices]
    parts = [p.cpu() for p in parts]
    if meta.query_lens is not None:
        parts.append(torch.tensor(meta.query_lens, dtype=torch.int64))
    floats = None
    if sampling is not None:
        seeds = [s if s is not None else 0 for s in sampling.seeds]
        has_seed = [int(s is not None) for s in sampling.seeds]
        top_k = [p.top_k for p in sampling.params]
        parts.append(torch.tensor(sampling.rows + sampling.request_ids + top_k + seeds + has_seed + released, dtype=torch.int64))
    parts.append(torch.tensor(busy + scored + prompt_targets + plan_ints, dtype=torch.int64))
    if num_sampled:
        floats = torch.tensor(
            [p.temperature for p in sampling.params] + [p.top_p for p in sampling.params] + plan_floats, dtype=torch.float64
        )
    return header, torch.cat(parts), floats


def int_payload_size(header: torch.Tensor) -> int:
    kind, rows, num_tokens, width, num_sampled, num_released, num_busy, num_logits, num_scored, num_targets, plan_ints = (
        int(header[i]) for i in (0, 3, 4, 6, 7, 8, 9, 10, 11, 12, 14)
    )
    size = 2 * num_tokens + rows * width + rows + num_logits + (rows if kind == PREFILL else 0)
    return size + 5 * num_sampled + num_released + num_busy + num_scored + num_targets + plan_ints


def float_payload_size(header: torch.Tensor) -> int:
    return 2 * int(header[7]) + int(header[15])


def decode(header: torch.Tensor, ints: torch.Tensor, floats: torch.Tensor | None) -> Message:
    (kind, micro_batch, slot, rows, num_tokens, bucket, width, num_sampled, num_released, num_busy, num_logits,
     num_scored, num_targets, logprobs_width, num_plan_ints, _num_plan_floats) = header[:16].tolist()
    if kind in (HEARTBEAT, SHUTDOWN):
        return Message(kind, micro_batch, slot)
    sizes = [num_tokens, num_tokens, rows * width, rows, num_logits]
    sizes += [rows] if kind == PREFILL else []
    sizes += [num_sampled] * 5 + [num_released, num_busy, num_scored, num_targets, num_plan_ints]
    *fields, busy, scored, prompt_targets, plan_ints = ints.split(sizes)
    positions, slot_mapping, tables, seq_lens, logits_indices = fields[:5]
    rest = fields[5:]
    query_lens = None
    if kind == PREFILL:
        query_lens, rest = rest[0].tolist(), rest[1:]
    seq_lens_list = seq_lens.tolist()
    meta = StepMetadata(
        positions=positions,
        slot_mapping=slot_mapping,
        block_tables=tables.view(rows, width),
        seq_lens=seq_lens,
        logits_indices=logits_indices,
        seq_lens_host=seq_lens_list,
        query_lens=query_lens,
    )
    sample_rows, request_ids, top_k, seeds, has_seed, released = (t.tolist() for t in rest)
    sampling = None
    if num_sampled or num_released or logprobs_width:
        values = floats.tolist() if num_sampled else []
        temperature, top_p = values[:num_sampled], values[num_sampled : 2 * num_sampled]
        params = [SamplingParams(max_tokens=None, temperature=t, top_k=k, top_p=p) for t, k, p in zip(temperature, top_k, top_p)]
        plan = LogitsPlan.from_wire(plan_ints.tolist(), values[2 * num_sampled :]) if num_plan_ints else None
        sampling = Sampling(
            sample_rows, request_ids, params, [s if h else None for s, h in zip(seeds, has_seed)], released,
            scored.tolist(), prompt_targets.tolist(), logprobs_width - 1, plan,
        )
    return Message(kind, micro_batch, slot, meta, bucket or None, sampling, counters=busy.tolist())


def send_message(link: Link, message: Message, dst: int) -> None:
    header, ints, floats = encode(message)
    tensors = [header]
    if message.meta is not None:
        tensors.append(ints)
        if floats is not None:
            tensors.append(floats)
        if message.hidden is not None:
            tensors.append(message.hidden)
    link.send(tensors, dst)


def recv_message(link: Link, src: int, buffers: list[torch.Tensor], timeout: datetime.timedelta | None = None) -> Message:
    """The next micro-batch from `src`; its hidden states land in `buffers[slot]` (this stage's)."""
    header = link.recv(torch.empty(HEADER_SIZE, dtype=torch.int64), src, timeout)
    if int(header[0]) in (HEARTBEAT, SHUTDOWN):
        return decode(header, torch.zeros(0, dtype=torch.int64), None)
    ints = link.recv(torch.empty(int_payload_size(header), dtype=torch.int64), src)
    num_sampled = int(header[7])
    floats = link.recv(torch.empty(float_payload_size(header), dtype=torch.float64), src) if num_sampled else None
    message = decode(header, ints, floats)
    message.hidden = link.recv(buffers[message.slot][: int(header[4])], src)
    return message


@dataclass
class Reply:
    """What the last rank sends rank 0 for a micro-batch (or a heartbeat, or the shutdown)."""

    kind: int
    micro_batch: int
    slot: int
    token_ids: torch.Tensor | None = None  # None without sampled rows
    counters: list[int] = field(default_factory=list)
    logprobs: tuple[torch.Tensor, torch.Tensor] | None = None  # values, alternatives' ids (graphrt.runtime.logprobs)


def send_reply(link: Link, reply: Reply) -> None:
    count = 0 if reply.token_ids is None else reply.token_ids.shape[0]
    values, top_ids = reply.logprobs if reply.logprobs is not None else (torch.zeros(0, 0), torch.zeros(0, 0))
    header = torch.tensor(
        [reply.kind, reply.micro_batch, reply.slot, count, len(reply.counters), values.shape[0], values.shape[1]], dtype=torch.int64
    )
    tensors = [header] + ([reply.token_ids.to(torch.int64)] if count else [])
    tensors += [torch.tensor(reply.counters, dtype=torch.int64)] if reply.counters else []
    tensors += [values.float()] if values.numel() else []
    tensors += [top_ids.to(torch.int64)] if top_ids.numel() else []  # none with 0 alternatives
    link.send(tensors, 0, reply=True)


def recv_reply(link: Link, src: int) -> Reply:
    kind, micro_batch, slot, count, num_busy, lp_rows, lp_width = link.recv(
        torch.empty(REPLY_SIZE, dtype=torch.int64), src, reply=True
    ).tolist()
    reply = Reply(kind, micro_batch, slot)
    if count:
        reply.token_ids = link.recv(torch.empty(count, dtype=torch.int64), src, reply=True)
    if num_busy:
        reply.counters = link.recv(torch.empty(num_busy, dtype=torch.int64), src, reply=True).tolist()
    if lp_rows * lp_width:
        values = link.recv(torch.empty(lp_rows, lp_width, dtype=torch.float32), src, reply=True)
        top_ids = torch.empty(lp_rows, lp_width - 2, dtype=torch.int64)  # after each row's logprob and rank
        if top_ids.numel():
            link.recv(top_ids, src, reply=True)
        reply.logprobs = values, top_ids
    return reply


def open_group(backend: str, init_method: str, timeout_s: float) -> tuple:
    """Process groups of our own (not torch's global default), so several can come and go in one
    process: the stages' and the replies'; then a function making another over the same store (the
    expert ranks'), and the store for the ranks' figures. `init_method`: env:// (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT) or tcp://H:P?rank=R&world_size=W."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world_size = next(dist.rendezvous(init_method, timeout=timeout))
    store.set_timeout(timeout)

    def group(name: str, rank: int, size: int):
        prefixed = dist.PrefixStore(name, store)
        if backend == "nccl":
            return dist.ProcessGroupNCCL(prefixed, rank, size)
        return dist.ProcessGroupGloo(prefixed, rank, size, timeout)

    stats = dist.PrefixStore("graphrt", store)
    return group("stages", rank, world_size), group("replies", rank, world_size), group, stats  # see Link
