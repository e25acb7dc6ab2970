"""Remote stages on rank 0: the engine's side of `--procs` (stages as processes, or hosts).

Rank 0 holds stage 0 only. `RemoteRing` is the ring with the same interface as the local one: a
micro-batch runs stage 0 on its stream, then the same stream sends the header, metadata and
hidden states to stage 1; the slot's event completes when the receive thread gets the token ids
back from the last stage. Under expert parallelism (--ep E) stage 0's other E - 1 ranks get each
micro-batch's token ids first and run stage 0 with rank 0; with a single stage (pp 1) rank 0
samples as the local ring does. A heartbeat flows round the ring when it is idle, so every rank hears
from its neighbour within the watchdog, and a monitor thread watches the worker processes rank 0
started. Any failure fails every micro-batch in flight with a `StageFailure` naming the stage.
"""

from __future__ import annotations

import atexit
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import torch

from graphrt.distributed.handshake import StagePlan, engine_handshake, wait_ready
from graphrt.distributed.transport import (
    DECODE,
    HEARTBEAT,
    PREFILL,
    SHUTDOWN,
    STATS_INTERVAL_S,
    Link,
    Message,
    RankStats,
    Sampling,
    StageFailure,
    counter_width,
    cpu_threads_per_stage,
    open_group,
    recv_reply,
    send_message,
    stage_name,
)
from graphrt.model.moe import WHOLE
from graphrt.model.weight_reads import WeightReads
from graphrt.runtime.pipeline import Pipeline, partition_layers
from graphrt.runtime.ring import MicroBatch, Ring, RingSlot
from graphrt.runtime.stage_builder import load_stage
from graphrt.runtime.streams import CpuStream, use_own_cuda_stream

STARTUP_TIMEOUT_S = 600.0  # loading and capturing a large stage can take minutes
EXIT_GRACE_S = 3.0  # after a failure, how long workers get to exit on their own before SIGTERM
MONITOR_INTERVAL_S = 0.1


def load_first_stage(cfg, files, devices, dtype, max_position, kernels="auto", layers=None, shard=WHOLE) -> Pipeline:
    """Pipeline.load for rank 0: stage 0 of len(devices) stages (of its routed experts, the
    `shard`'s), and nothing else."""
    first = (layers or partition_layers(cfg, len(devices)))[0]
    return Pipeline([load_stage(cfg, 0, len(devices), first, devices[0], dtype, max_position, kernels, files, shard)], [])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn_workers(model_dir, config, port: int) -> list[subprocess.Popen]:
    """Ranks 1..pp * ep - 1 on this host, as `python -m graphrt.worker` with torchrun's environment."""
    world_size = config.pp * config.ep
    args = [sys.executable, "-m", "graphrt.worker", "--model", str(model_dir), "--watchdog-s", str(config.watchdog_s)]
    args += ["--ep", str(config.ep)] if config.ep > 1 else []
    if config.dtype != "auto":
        args += ["--dtype", str(config.dtype).removeprefix("torch.")]
    if config.devices:
        args += ["--devices", ",".join(config.devices)]
    children = []
    for rank in range(1, world_size):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
        children.append(subprocess.Popen(args, env=env))
    return children


def check_one_rank_per_gpu(config) -> None:
    """NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), and only at the first send:
    refuse a GPU that `config.devices` (one per rank) names twice before any process starts. Only
    for the ranks rank 0 starts on this host: torchrun's may be on several hosts, each with a cuda:0."""
    ranks_on: dict[int, list[int]] = {}
    for rank, device in enumerate(map(torch.device, config.devices)):
        if device.type == "cuda":  # "cuda" is cuda:0, as for num_concurrent_stages
            ranks_on.setdefault(device.index or 0, []).append(rank)
    for index, ranks in ranks_on.items():
        if len(ranks) > 1:
            named = ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"
            layout = f"--pp {config.pp} --ep {config.ep}: rank = stage * ep + expert rank" if config.ep > 1 else "--procs: rank = stage"
            instead = "; or drop --procs to run the stages as streams of one process" if config.ep == 1 else ""
            raise ValueError(
                f"--devices puts ranks {named} on cuda:{index} ({layout}), but NCCL refuses two ranks on one GPU; "
                f"give each rank a GPU of its own{instead}"
            )


class RemoteEvent:
    """A slot's event: set when its tokens are back from the last rank, or failed."""

    def __init__(self):
        self._done = threading.Event()
        self.error: BaseException | None = None
        self.sent = None  # stage 0's event after its send: an error there (a bug in stage 0) surfaces here

    def query(self) -> bool:
        return self._done.is_set() or (self.sent is not None and self.sent.query() and self.sent.error is not None)

    def wait(self, timeout_s: float) -> bool:
        """Whether the tokens are back (or the pipeline failed) within `timeout_s`."""
        return self._done.wait(timeout_s)

    def synchronize(self) -> None:
        while not self._done.wait(0.05):
            if self.sent is not None and self.sent.query() and self.sent.error is not None:
                raise self.sent.error
        if self.error is not None:
            raise self.error

    def _set(self, error: BaseException | None = None) -> None:
        self.error = error
        self._done.set()


class Cluster:
    """Rank 0's view of the other ranks: the link, the processes it started, the watchdog."""

    def __init__(self, link: Link, children: list[subprocess.Popen], watchdog_s: float):
        self.link, self.children, self.watchdog_s = link, children, watchdog_s
        self.failure: StageFailure | None = None
        self.first_exit: tuple[str, int] | None = None  # the first worker seen to have exited (its name), and its code
        self.rank_weight_reads: list[WeightReads] = []  # each worker's weights (ranks 1..), once they report ready
        self.rank_stats: list[RankStats] = [RankStats()] * (link.world_size - 1)  # under --ep, each worker's, as last read
        self.ring: RemoteRing | None = None
        self._pending: dict[int, tuple[RemoteEvent, MicroBatch]] = {}  # micro-batch id -> (its event, it)
        self._lock = threading.Lock()
        self.closing = threading.Event()
        self._run(self._monitor, "graphrt-monitor")

    @staticmethod
    def start(model_dir, config) -> Cluster:
        """Join torchrun's ranks (RANK=0 in the environment) or start the pp * ep - 1 workers on this host."""
        device = torch.device(config.devices[0]) if config.devices else torch.device("cuda" if torch.cuda.is_available() else "cpu")
        backend = "nccl" if device.type == "cuda" else "gloo"
        world_size = config.pp * config.ep
        if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(cpu_threads_per_stage(world_size))
        if os.environ.get("RANK") == "0" and "WORLD_SIZE" in os.environ:
            if int(os.environ["WORLD_SIZE"]) != world_size:
                raise ValueError(
                    f"--pp {config.pp} --ep {config.ep} makes {world_size} ranks but WORLD_SIZE is {os.environ['WORLD_SIZE']}; "
                    "start pp * ep ranks"
                )
            children, init_method = [], "env://"
        else:
            if backend == "nccl" and config.devices:
                check_one_rank_per_gpu(config)
            if backend == "nccl" and torch.cuda.device_count() < world_size:
                # NCCL refuses two ranks on one GPU ("Duplicate GPU detected") at the first send.
                layout = f"--pp {config.pp}" + (f" --ep {config.ep}" if config.ep > 1 else "")
                instead = "; drop --procs to run the stages as streams of one process" if config.ep == 1 else ""
                raise ValueError(
                    f"--procs with {layout} needs {world_size} GPUs on this host (one per rank), found {torch.cuda.device_count()}{instead}"
                )
            port = free_port()
            children = spawn_workers(model_dir, config, port)
            init_method = f"tcp://127.0.0.1:{port}?rank=0&world_size={world_size}"
        group = _open_watching(children, backend, init_method, config.ep)
        link = Link(
            group, 0, world_size, device if backend == "nccl" else torch.device("cpu"), config.watchdog_s, config.ep, STARTUP_TIMEOUT_S
        )
        cluster = Cluster(link, children, config.watchdog_s)
        atexit.register(cluster.close)  # a CLI that never closes its engine still stops its workers cleanly
        return cluster

    # -- start-up ---------------------------------------------------------------------------------

    @property
    def samples_here(self) -> bool:
        """Whether rank 0 holds the last stage too (one stage, split over expert ranks) and samples."""
        return self.link.pp == 1

    def handshake(self, plan: StagePlan) -> None:
        """Send every rank the plan rank 0 decided; on a mismatch every rank stops naming the field."""
        self._starting(lambda: engine_handshake(self.link, plan, STARTUP_TIMEOUT_S))
        self.link.join_expert_group()

    def wait_ready(self) -> None:
        """After stage 0's capture (its other expert ranks capture with it): every worker's."""
        self.rank_weight_reads = self._starting(lambda: wait_ready(self.link, STARTUP_TIMEOUT_S))

    @property
    def remote_weight_reads(self) -> WeightReads:
        """The workers' weight bytes, all together."""
        return sum(self.rank_weight_reads, WeightReads(0))

    def _starting(self, step):
        try:
            return step()
        except StageFailure as exc:
            self.fail_soon(str(exc))
            self.close()
            raise

    def make_ring(self, pipeline, graphs, sampler, **options) -> RemoteRing:
        self.ring = RemoteRing(pipeline, graphs, sampler, cluster=self, **options)
        self._receiver = None if self.samples_here else self._run(self._receive, "graphrt-receive")
        self._run(self._heartbeat, "graphrt-heartbeat")
        if self.link.ep > 1:
            self._run(self._read_rank_stats, "graphrt-rank-stats")
        return self.ring

    # -- micro-batches ----------------------------------------------------------------------------

    def expect(self, mb: MicroBatch) -> RemoteEvent:
        event = RemoteEvent()
        with self._lock:
            if self.failure is not None:
                event._set(self.failure)
            else:
                self._pending[mb.id] = (event, mb)
        return event

    def send(self, message: Message, to_stage_one: bool = True, to_expert_ranks: bool = True) -> None:
        """On stage 0's stream: pass a micro-batch (or heartbeat, or shutdown) to stage 1, and what
        stage 0's other expert ranks need of it to them."""
        if self.failure is not None:
            raise self.failure
        try:
            for peer in self.link.expert_peers if to_expert_ranks else []:
                send_message(self.link, message.for_expert_ranks(), peer)
            if to_stage_one and self.link.pp > 1:
                send_message(self.link, message, self.link.leader(1))
        except StageFailure as exc:
            self.fail_soon(str(exc))
            raise

    def _receive(self) -> None:
        # Replies arrive on a stream of their own: on the default stream, stage 0's next
        # micro-batch would queue behind a reply still on its way.
        try:
            use_own_cuda_stream(self.link.device)
        except Exception as exc:  # noqa: BLE001 - no replies can be read: say so rather than hang
            self.fail(f"{stage_name(0)} cannot receive replies on {self.link.device} ({exc})")
            return
        last = self.link.leader(self.link.pp - 1)
        while True:
            try:
                reply = recv_reply(self.link, last)
            except StageFailure as exc:
                if not self.closing.is_set():
                    self.fail_soon(str(exc))
                return
            if reply.kind == SHUTDOWN:
                return
            if reply.kind == HEARTBEAT:
                continue
            if reply.counters:
                self.ring.read_counters(reply.counters)
            with self._lock:
                event, mb = self._pending.pop(reply.micro_batch, (None, None))
            if event is not None:
                if reply.token_ids is not None:
                    self.ring.host_tokens[mb.token_base : mb.token_base + reply.token_ids.shape[0]].copy_(reply.token_ids)
                if reply.logprobs is not None:
                    mb.logprobs.values.copy_(reply.logprobs[0])
                    mb.logprobs.top_ids.copy_(reply.logprobs[1])
                event._set()

    def _heartbeat(self) -> None:
        interval = self.watchdog_s / 4
        while not self.closing.wait(interval):
            if self.failure is not None:
                return
            if time.monotonic() - self.ring.last_sent >= interval and not self.ring.heartbeat_queued:
                self.ring.queue_heartbeat()

    def _read_rank_stats(self) -> None:
        """The workers' figures from the store, every STATS_INTERVAL_S: the engine's snapshot reads
        them each step, so they are read here, off its thread."""
        while not self.closing.wait(STATS_INTERVAL_S):
            if self.failure is not None:
                return
            try:
                self.rank_stats = [self.link.read_stats(rank) for rank in range(1, self.link.world_size)]
            except Exception:  # noqa: BLE001 - the store went with rank 0's failure or close; the figures stay as they were
                return

    # -- failure ----------------------------------------------------------------------------------

    def _monitor(self) -> None:
        while not self.closing.wait(MONITOR_INTERVAL_S):
            if self.failure is None:
                self._check_children()

    def _check_children(self) -> None:
        exited = [(rank, code) for rank, child in enumerate(self.children, start=1) if (code := child.poll()) is not None]
        if not exited or self.closing.is_set():
            return
        # Its neighbours exit soon after one dies (they lose it), and may be seen first: a process
        # a signal ended is named first, the others after it.
        exited.sort(key=lambda exit: exit[1] >= 0)
        (rank, code), others = exited[0], exited[1:]
        after = "; then " + ", ".join(f"{self.link.name(r)} with code {c}" for r, c in others) if others else ""
        self.first_exit = self.link.name(rank), code
        self.fail(f"{self.link.name(rank)} exited with code {code}{after}")

    def fail_soon(self, message: str) -> None:
        """A broken link, or a failed collective: if a process rank 0 started has died (within a
        second), name it rather than the neighbour that lost it."""
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and self.failure is None and self.children:
            self._check_children()
            time.sleep(MONITOR_INTERVAL_S)
        self.fail(message)

    def fail(self, message: str) -> None:
        """Fail every micro-batch in flight (and every later one); stop the workers rank 0 started."""
        with self._lock:
            if self.failure is not None:
                return
            self.failure = StageFailure(f"{message}; the pipeline is down, restart graphrt")
            pending, self._pending = [event for event, _mb in self._pending.values()], {}
        print(f"[graphrt] {stage_name(0)} stops: {self.failure}", file=sys.stderr, flush=True)
        for event in pending:
            event._set(self.failure)
        self._run(self._reap, "graphrt-reap")

    def _reap(self) -> None:
        """Workers notice a broken neighbour themselves; whoever has not exited after a grace is stopped."""
        deadline = time.monotonic() + EXIT_GRACE_S
        for signal_them in (subprocess.Popen.terminate, subprocess.Popen.kill):
            for child in self.children:
                try:
                    child.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    signal_them(child)
            deadline = time.monotonic() + EXIT_GRACE_S

    def close(self) -> None:
        """Tell every worker to stop (they exit 0) and wait for them; after a failure, just reap."""
        if self.closing.is_set():
            return
        self.closing.set()
        if self.failure is None and self.ring is not None:
            self.ring.streams[0].submit(lambda: self.send(Message(SHUTDOWN, -1, 0)))
            self.ring.streams[0].close()
            if self._receiver is not None:
                self._receiver.join(self.watchdog_s)  # the receive thread ends at the shutdown reply
        for child in self.children:
            try:
                child.wait(self.watchdog_s if self.failure is None else 2 * EXIT_GRACE_S + 1)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        # Let gloo go now, while this process is whole: a group torn down at interpreter exit with
        # its peers gone aborts the process.
        for group in filter(None, (self.link.group, self.link.reply_group, self.link.expert_group)):
            try:
                (group.abort if self.failure is not None else group.shutdown)()
            except Exception:  # noqa: BLE001 - best effort; the peers are gone either way
                pass

    def _run(self, target, name: str) -> threading.Thread:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        return thread


def _kind(mb: MicroBatch) -> int:
    return PREFILL if mb.step.is_prefill else DECODE


def _open_watching(children: list[subprocess.Popen], backend: str, init_method: str, ep: int):
    """open_group, but a worker that dies while the ranks meet is reported at once, not after the timeout."""
    result: list = []

    def meet() -> None:
        try:
            result.append(open_group(backend, init_method, STARTUP_TIMEOUT_S))
        except Exception as exc:  # noqa: BLE001 - re-raised below
            result.append(exc)

    thread = threading.Thread(target=meet, name="graphrt-rendezvous", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(MONITOR_INTERVAL_S)
        for rank, child in enumerate(children, start=1):
            if child.poll() is not None:
                for other in children:
                    other.kill()
                raise StageFailure(f"{stage_name(rank, ep)} exited with code {child.returncode} before the ranks met; its output says why")
    if isinstance(result[0], Exception):
        for child in children:
            child.kill()
        raise StageFailure(f"the ranks could not meet at {init_method}: {result[0]}")
    return result[0]


@dataclass
class RemoteRing(Ring):
    """The ring, with stages 1..pp-1 in other processes. Stage 0 runs here as in `Ring`, writing its
    output into the slot's buffer for stage 1, from which the same stream sends it. With one stage
    (its expert ranks in other processes) it samples here, as `Ring` does."""

    cluster: Cluster | None = None
    last_sent: float = field(init=False, default_factory=time.monotonic)
    heartbeat_queued: bool = field(init=False, default=False)
    remote_busy_s: list[float] = field(init=False, default_factory=list)  # stages 1.., as of the last reply
    remote_expert_tokens: list[list[int]] = field(init=False, default_factory=list)  # likewise
    remote_expert_reads: list[int] = field(init=False, default_factory=list)  # likewise

    def __post_init__(self) -> None:
        super().__post_init__()
        stage = self.pipeline.stages[0]
        if not stage.is_last:
            for slot in self.slots:
                slot.recv.append(torch.empty(self.max_tokens, stage.cfg.hidden_size, dtype=stage.dtype, device=stage.device))

    @property
    def defers_masks(self) -> bool:
        return False  # the last rank samples what the step's header carries: every mask is made at launch

    @property
    def stage_busy_s(self) -> list[float]:
        """Stage 0's busy seconds, measured here, then the other stages' from the last reply."""
        remote = self.remote_busy_s or [0.0] * (self.cluster.link.pp - 1)
        return [self.busy_s[0], *remote]

    def read_counters(self, counters: list[int]) -> None:
        """The stage counters of a reply: stages 1..'s busy seconds and expert load."""
        pp = self.cluster.link.pp
        width = len(counters) // pp
        records = [counters[stage * width : (stage + 1) * width] for stage in range(1, pp)]
        self.remote_busy_s = [record[0] / 1e6 for record in records]
        # A dense stage of a mixture of experts reports zeros past its busy time: no reads, no tokens.
        self.remote_expert_reads = [record[1] if len(record) > 1 else 0 for record in records]
        self.remote_expert_tokens = [record[2:] for record in records]

    @property
    def stage_expert_tokens(self) -> list[list[int]]:
        """Stage 0's tokens per expert, read here, then the other stages' from the last reply."""
        remote = self.remote_expert_tokens or [[] for _ in range(self.cluster.link.pp - 1)]
        return [self.pipeline.stages[0].seen_expert_tokens(), *remote]

    @property
    def stage_expert_reads(self) -> list[int]:
        """Stage 0's experts read by decode steps, read here, then the other stages' from the last reply."""
        remote = self.remote_expert_reads or [0] * (self.cluster.link.pp - 1)
        return [self.pipeline.stages[0].seen_expert_reads(), *remote]

    def _make_feed(self) -> torch.Tensor:
        return self.host_tokens  # the receive thread writes the tokens there; stage 0 reads them on the host

    def _wait_on_stage0(self, earlier: MicroBatch) -> None:
        """Stage 0's thread waits for the earlier micro-batch's reply, and as it also sends the
        heartbeats, it keeps sending them meanwhile: rank 1 may be idle for as long as the reply
        takes, and must not take rank 0 for dead."""
        if self.cluster.samples_here:  # done on this very stream
            super()._wait_on_stage0(earlier)
            return
        reply = earlier.done
        interval = self.cluster.watchdog_s / 4

        def wait() -> None:
            while not reply.wait(interval):
                self._beat()
            if reply.error is not None:
                raise reply.error

        self.streams[0].submit(wait)

    def _make_streams(self) -> list:
        # A thread even on CUDA: sends, heartbeats and shutdown must leave rank 0 in one order.
        stage = self.pipeline.stages[0]
        hook = stage.ops.stream_hook
        return [CpuStream("graphrt-stage0", stage.device, hooks=hook() if hook is not None else None)]

    def _enqueue(self, slot: RingSlot, mb: MicroBatch, token_ids, meta, producers: list[MicroBatch]) -> None:
        super()._enqueue(slot, mb, token_ids, meta, producers)
        if self.cluster.samples_here:
            return
        event = self.cluster.expect(mb)  # before the send is queued, so the reply always finds it
        sampling = self._sampling(mb)
        self.streams[0].submit(lambda: self._send(Message(_kind(mb), mb.id, slot.index, meta, mb.bucket, sampling), slot, token_ids.shape[0]))
        event.sent = self.streams[0].record()
        mb.done = event

    def _run_stage(self, index, slot, mb, token_ids, meta, params, generators) -> None:
        if self.cluster.link.expert_peers:  # stage 0's other expert ranks run it with this one: they need its input
            ids = self._input_ids(token_ids, mb)
            self.cluster.send(Message(_kind(mb), mb.id, slot.index, meta, mb.bucket, hidden=ids), to_stage_one=False)
        super()._run_stage(index, slot, mb, token_ids, meta, params, generators)
        device = self.pipeline.stages[0].device
        if self.cluster.samples_here and device.type == "cuda":
            # This thread's event is the micro-batch's: its tokens must be on the host when it is set.
            torch.cuda.current_stream(device).synchronize()

    def reset(self, cause: str) -> None:
        """Stage processes can't be drained from here: late writes of lost micro-batches could land
        in freed blocks, so the whole pipeline stops instead (workers exit, naming the cause)."""
        self.cluster.fail_soon(cause)
        self._forget_in_flight()

    def _send(self, message: Message, slot: RingSlot, num_tokens: int) -> None:
        message.hidden = slot.recv[1][:num_tokens]
        # each stage writes its own as it passes
        message.counters = [0] * self.cluster.link.pp * counter_width(self.pipeline.stages[0].cfg)
        self.cluster.send(message, to_expert_ranks=False)  # they had theirs before stage 0 ran
        self.last_sent = time.monotonic()

    def _holds_state(self, params) -> bool:
        """The last rank also keeps each seeded request's generator, made from the seed it is sent
        (unless this rank samples: one stage split over expert ranks)."""
        return (params.seed is not None and not self.cluster.samples_here) or super()._holds_state(params)

    def _sampling(self, mb: MicroBatch) -> Sampling:
        seqs = mb.sampled_seqs
        # A decode step samples at each of its tokens, a verify row's drafts too (the ring's
        # _sample): one entry per token, each of a row's sharing its request's params and generator.
        counts = mb.step.sample_counts
        rows = mb.sample_rows if mb.step.is_prefill else list(range(sum(counts)))
        each = [seq for seq, count in zip(seqs, counts) for _ in range(count)]
        sampling = Sampling(
            rows, [s.request_id for s in each], [s.params for s in each], [s.params.seed for s in each], mb.released,
            logits_plan=mb.logits_plan,
        )
        if mb.logprobs is not None:
            sampling.scored, sampling.prompt_targets, sampling.num_top = mb.logprobs.sampled, mb.logprobs.prompt_targets, mb.logprobs.num_top
        return sampling

    def queue_heartbeat(self) -> None:
        self.heartbeat_queued = True

        def beat() -> None:
            self.heartbeat_queued = False
            self._beat()

        self.streams[0].submit(beat)

    def _beat(self) -> None:
        """On stage 0's thread, in order with the micro-batches it sends."""
        if not self.cluster.closing.is_set():
            self.cluster.send(Message(HEARTBEAT, -1, 0))
            self.last_sent = time.monotonic()

    def close(self) -> None:
        self.cluster.close()
        for stream in self.streams:
            stream.close()
