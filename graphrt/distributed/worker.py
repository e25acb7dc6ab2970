"""A stage process: what `python -m graphrt.worker [ARGS]` (graphrt/worker.py) runs on every rank beyond the first.

Rank k > 0 holds only stage k: its weights, its KV cache, its graphs (captured here). It receives
micro-batches from rank k-1, runs them, and passes the hidden states to rank k+1; the last rank
samples and sends the token ids back to rank 0. Under expert parallelism (--ep E) rank r runs stage
r // E with its share of the routed experts; the stage's leader (expert rank 0) passes each message
to the stage's other ranks before running it (graphrt/distributed/transport.py). Rank 0 runs the engine: under torchrun, rank 0 of
this same command runs `graphrt ARGS --procs` (e.g. `python -m graphrt.worker serve --pp 8 ...`).

Environment (torchrun sets it; `--procs` sets it for the workers it starts): RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, and LOCAL_RANK for the GPU of this process.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from graphrt.capture.buckets import BucketPlan, parse_buckets
from graphrt.capture.capture import capture_stage
from graphrt.capture.manifest import model_fingerprint
from graphrt.config import parse_dtype
from graphrt.distributed.handshake import StagePlan, WorkerView, report_ready, worker_handshake
from graphrt.distributed.transport import (
    HEARTBEAT,
    PREFILL,
    SHUTDOWN,
    STATS_INTERVAL_S,
    Link,
    Message,
    RankStats,
    Reply,
    cpu_threads_per_stage,
    open_group,
    recv_message,
    send_message,
    send_reply,
    stage_name,
)
from graphrt.errors import GraphrtError
from graphrt.kernels.cpu.kernel_choice import choose_greedy_argmax
from graphrt.kernels.cpu.kernel_choice import mode_from_env as cpu_kernel_mode_from_env
from graphrt.kernels.cpu.matmul_choice import mode_from_env
from graphrt.kernels.cpu.stage_kernels import choose_matmuls
from graphrt.model.config import ModelConfig
from graphrt.model.kv_cache import StageKVCache
from graphrt.model.moe import ExpertShard
from graphrt.model.weights import WeightFiles
from graphrt.profiling.nvtx import Ranges
from graphrt.profiling.timeline import Timeline
from graphrt.runtime.logprobs import score_rows
from graphrt.runtime.pipeline import partition_layers
from graphrt.runtime.sampler import Sampler
from graphrt.runtime.stage_builder import choose_stage_ops, load_stage

DEFAULT_WATCHDOG_S = 30.0
DEFAULT_STARTUP_TIMEOUT_S = 600.0


@dataclass
class WorkerOptions:
    model: Path
    dtype: str | None = None  # None: rank 0's
    buckets: list[int] | None = None  # None: rank 0's
    device: str | None = None  # None: cuda:LOCAL_RANK with CUDA, else cpu
    ep: int = 1
    watchdog_s: float = DEFAULT_WATCHDOG_S
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S


def parse_options(args: list[str]) -> WorkerOptions:
    """The options a worker needs, read from the same command line rank 0 gets (the rest is ignored)."""
    parser = argparse.ArgumentParser(prog="python -m graphrt.worker", add_help=False)
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--buckets", default=None)
    parser.add_argument("--devices", default=None)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--watchdog-s", type=float, default=DEFAULT_WATCHDOG_S)
    parser.add_argument("--startup-timeout-s", type=float, default=DEFAULT_STARTUP_TIMEOUT_S)
    known, _ = parser.parse_known_args(args)
    world_size = int(os.environ["WORLD_SIZE"])
    if known.ep < 1 or world_size % known.ep:
        raise SystemExit(f"error: --ep {known.ep} must be a positive divisor of WORLD_SIZE ({world_size}): pp * ep ranks")
    from graphrt.model.default_model import model_dir_for

    known.model = model_dir_for(known.model)
    rank = int(os.environ["RANK"])
    devices = [d.strip() for d in known.devices.split(",")] if known.devices else None
    return WorkerOptions(
        model=known.model,
        dtype=known.dtype if known.dtype not in (None, "auto") else None,
        buckets=parse_buckets(known.buckets) if known.buckets else None,
        device=devices[rank] if devices else None,
        watchdog_s=known.watchdog_s,
        startup_timeout_s=known.startup_timeout_s,
        ep=known.ep,
    )


class StageWorker:
    """One stage's loop: receive, run, pass on (or sample and answer rank 0)."""

    def __init__(self, link: Link, plan: StagePlan, options: WorkerOptions, device: torch.device):
        self.link, self.plan, self.rank = link, plan, link.rank
        self.startup_timeout_s = options.startup_timeout_s
        cfg = ModelConfig.from_dir(options.model)
        dtype = parse_dtype(plan.dtype)
        index = link.stage
        self.leads = link.expert_rank == 0  # talks to the stages around it; the others only run the stage
        self.source = link.leader(index - 1) if self.leads else link.leader(index)
        # Built as rank 0 builds its stages (graphrt.runtime.stage_builder), then captured as it does.
        shard = ExpertShard(link.expert_rank, link.ep)
        files = WeightFiles(options.model)
        # the leader of the last stage samples; its other expert ranks need no LM head
        self.stage = load_stage(
            cfg, index, plan.pp, plan.layers[index], device, dtype, plan.max_model_len, plan.kernels, files, shard, head=self.leads
        )
        if link.ep > 1:
            self.stage.combine_experts_with(link.combine_experts, Ranges())
        # The leader's choices on its other expert ranks, so that the replicated work runs (and rounds) alike on every rank.
        leader_matmuls, leader_ops = (None, None) if self.leads else link.leader_kernels()
        max_rows = max(plan.buckets)
        matmuls = choose_matmuls(self.stage, max_rows, mode_from_env(), leader_matmuls.by_name() if leader_matmuls else None)
        self.kernels = choose_stage_ops(self.stage, matmuls, max_rows, plan.block_size, cpu_kernel_mode_from_env(), leader_ops)
        if link.ep > 1:
            link.publish_kernels(self.kernels)
        self.cache = StageKVCache.allocate(cfg, len(plan.layers[index]), plan.num_blocks, plan.block_size, device, dtype)
        max_blocks = -(-plan.max_model_len // plan.block_size)
        self.graphs, _ = capture_stage(
            self.stage, self.cache, BucketPlan(tuple(plan.buckets)), max_blocks, plan.use_cuda_graphs,
            plan.allow_eager, set(), show_progress=False,
        )
        # what arrives for each slot: hidden states, or on stage 0 (an expert rank beside the engine) token ids
        width = () if self.stage.is_first else (cfg.hidden_size,)
        input_dtype = torch.int64 if self.stage.is_first else dtype
        self.buffers = [torch.empty(plan.max_tokens, *width, dtype=input_dtype, device=device) for _ in range(plan.num_slots)]
        self.sampler = None
        if self.stage.is_last and self.leads:
            greedy_argmax, _ = choose_greedy_argmax(device, cfg.vocab_size, max(plan.buckets), cpu_kernel_mode_from_env())
            self.sampler = Sampler(device, plan.seed, greedy_argmax)
        self.generators: dict[int, torch.Generator] = {}  # request id -> its seeded generator
        self.busy_s = 0.0
        self.first_at: float | None = None
        self.timeline = Timeline([device]) if plan.timeline else None
        self.experts = shard.experts(cfg.moe.num_experts) if cfg.moe is not None else range(0)

    def run(self) -> None:
        """Until rank 0 says stop; a dead or silent neighbour raises StageFailure."""
        # Rank 0 sends nothing until every rank is ready, which may take as long as start-up.
        timeout = datetime.timedelta(seconds=self.startup_timeout_s)
        while True:
            message = recv_message(self.link, self.source, self.buffers, timeout)
            if timeout is not None:
                self.link.started()
                timeout = None
            for peer in self.link.expert_peers:  # before running: they run the stage with this rank
                send_message(self.link, message.for_expert_ranks(), peer)
            if message.kind in (HEARTBEAT, SHUTDOWN):
                self._pass_on(message, None)
                if message.kind == SHUTDOWN:
                    return
                continue
            started = time.perf_counter()
            self.first_at = self.first_at or started
            slice_start = self.timeline.begin(self.stage.device) if self.timeline else None
            combine_before = self.link.combine_s
            meta = message.meta.to(self.stage.device)
            if message.kind == PREFILL:
                out = self.stage(message.hidden, meta, self.cache)
            else:
                out = self.graphs.run(message.hidden, meta)
            reply = self._sample(message, out) if self.sampler is not None else None
            self.busy_s += time.perf_counter() - started
            if self.timeline:
                self.timeline.end(
                    self.stage.device, slice_start, stage=self.link.stage, slot=message.slot, micro_batch=message.micro_batch,
                    kind="prefill" if message.kind == PREFILL else "decode", rows=meta.seq_lens.shape[0], bucket=message.bucket,
                    rank=self.rank, expert_rank=self.link.expert_rank, combine_s=self.link.combine_s - combine_before,
                )
            self.stage.publish_expert_tokens()
            if message.counters:  # rank 0 reports every stage's busy time and expert load from these (/metrics)
                experts = self.stage.seen_expert_tokens()
                record = [int(self.busy_s * 1e6), *([self.stage.seen_expert_reads(), *experts] if experts else [])]
                width = len(message.counters) // self.link.pp
                record += [0] * (width - len(record))  # a dense stage of a mixture of experts routes nothing
                index = self.link.stage
                message.counters[index * width : (index + 1) * width] = record
            self._pass_on(message, out if not self.stage.is_last else None, reply)

    @property
    def publishes(self) -> bool:
        """Whether this rank has figures for rank 0 to read: under --ep, or with the timeline on."""
        return self.link.ep > 1 or self.timeline is not None

    def publish(self, stop: threading.Event) -> None:
        """On a thread of its own, every STATS_INTERVAL_S: under --ep this rank's figures whenever they
        changed, with the timeline on its newest finished slices; off the micro-batches' path (the
        store is a round trip to rank 0's host)."""
        stats_published, slices_published, chunk = None, 0, 0
        while not stop.wait(STATS_INTERVAL_S):
            try:
                if self.link.ep > 1:
                    expert_tokens = sum(self.stage.seen_expert_tokens()[self.experts.start : self.experts.stop])
                    stats = RankStats(self.busy_s, self.link.combine_s, expert_tokens)
                    if stats != stats_published:
                        self.link.publish_stats(stats)
                        stats_published = stats
                if self.timeline is not None and (fresh := self.timeline.wall_slices(since=slices_published)):
                    self.link.publish_slices(chunk, fresh)
                    slices_published, chunk = slices_published + len(fresh), chunk + 1
            except Exception:  # noqa: BLE001 - the store went with rank 0 (the loop finds out and says so); figures never stop a stage
                return

    def _sample(self, message: Message, out: torch.Tensor) -> Reply:
        """The last stage's answer: the sampled rows' tokens, and the logprobs asked for."""
        reply = Reply(message.kind, message.micro_batch, message.slot)
        sampling = message.sampling
        if sampling is None:
            return reply
        if sampling.released:
            self.sampler.release(sampling.released)
        logits = None
        if sampling.rows:
            logits = out if len(sampling.rows) == out.shape[0] else out[torch.tensor(sampling.rows, device=out.device)]
            generators = []
            for request_id, seed in zip(sampling.request_ids, sampling.seeds):
                if seed is not None and request_id not in self.generators:
                    self.generators[request_id] = self.sampler.request_generator(seed)
                generators.append(self.generators.get(request_id) if seed is not None else None)
            reply.token_ids = self.sampler(logits, sampling.params, generators, sampling.logits_plan)
        if sampling.num_top >= 0:
            num_rows = message.meta.seq_lens.shape[0]
            reply.logprobs = score_rows(
                out, logits, reply.token_ids, sampling.scored, num_rows, sampling.prompt_targets, sampling.num_top
            )
        for request_id in sampling.released:
            self.generators.pop(request_id, None)
        return reply

    def _pass_on(self, message: Message, out: torch.Tensor | None, reply: Reply | None = None) -> None:
        if not self.leads:
            return
        if self.stage.is_last:
            reply = reply or Reply(message.kind, message.micro_batch, message.slot)
            reply.counters = message.counters or []
            send_reply(self.link, reply)
        else:
            message.hidden = out
            send_message(self.link, message, self.link.leader(self.link.stage + 1))

    def busy_report(self) -> str:
        if self.first_at is None:
            return f"{self.link.name(self.rank)}: ran no micro-batch"
        span = time.perf_counter() - self.first_at
        return f"{self.link.name(self.rank)}: busy {self.busy_s:.2f} s of {span:.2f} s since its first micro-batch ({self.busy_s / span:.0%})"


def worker_view(options: WorkerOptions, world_size: int, device: torch.device):
    def view(plan: StagePlan) -> WorkerView:
        cfg = ModelConfig.from_dir(options.model)
        dtype = str(parse_dtype(options.dtype)).removeprefix("torch.") if options.dtype else None
        pp = world_size // options.ep
        layers = partition_layers(cfg, pp, plan.partition_rows)  # rank 0's rows: a MoE partition depends on them
        return WorkerView(model_fingerprint(options.model), layers, pp, dtype, options.buckets, options.ep)

    return view


def run_worker(options: WorkerOptions) -> int:
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if options.device is not None:
        device = torch.device(options.device)
    elif torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    else:
        device = torch.device("cpu")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(cpu_threads_per_stage(world_size))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    group = open_group(backend, "env://", options.startup_timeout_s)
    link = Link(
        group, rank, world_size, device if backend == "nccl" else torch.device("cpu"), options.watchdog_s, options.ep,
        options.startup_timeout_s,
    )
    worker = None
    try:
        plan = worker_handshake(link, worker_view(options, world_size, device), options.startup_timeout_s)
        link.join_expert_group()
        try:
            worker = StageWorker(link, plan, options, device)
        except Exception as exc:
            # This rank's output says why (one line for a mistake the user can fix, a traceback for
            # a bug); rank 0 is told only that it failed.
            if isinstance(exc, GraphrtError):
                print(f"[graphrt] {stage_name(rank, options.ep)} could not load its stage: {exc}", file=sys.stderr, flush=True)
            else:
                traceback.print_exc()
            # Not waiting long: rank 0 may be capturing with this stage's other ranks, who learn of
            # the failure when this process exits and their all-reduce loses it.
            with contextlib.suppress(GraphrtError):  # rank 0, busy with the stage's other ranks, learns it when this exits
                report_ready(link, None, min(options.watchdog_s, 1.0))
            if isinstance(exc, GraphrtError):
                return 1
            raise
        report_ready(link, worker.stage.weight_reads(), options.startup_timeout_s)
        stop = threading.Event()
        publisher = threading.Thread(target=worker.publish, args=(stop,), name="graphrt-rank-stats", daemon=True)
        if worker.publishes:
            publisher.start()
        try:
            worker.run()
        finally:
            stop.set()
    except GraphrtError as exc:
        print(f"[graphrt] {stage_name(rank, options.ep)} stops: {exc}", file=sys.stderr, flush=True)
        return 1
    print(f"[graphrt] {worker.busy_report()}", file=sys.stderr, flush=True)
    return 0
