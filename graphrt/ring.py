"""The micro-batch ring: L = pp + depth slots moving through the stages at once.

Each slot owns, on every stage, the buffer its activations arrive in, so micro-batches running at
once never share memory. Launching a micro-batch enqueues, stage by stage on that stage's stream:
wait for the previous stage's event, run the stage (the bucket's graph for decode, eager for
prefill), copy the output into the next stage's receive buffer for this slot, record an event.
The last stage samples on device and writes the token ids twice: into the token feed on stage 0's
device, where the next step of those sequences reads them, and into pinned host memory, which the
host reads once the micro-batch's event has passed.

Async scheduling: a slot holds up to `max_per_slot` micro-batches. The second one is launched before
the first is read back; its stage 0 waits (on the device, not the host) for the first to leave
the last stage, then takes its input tokens from the feed. The host so decides a whole ring ahead
and its turnaround (read-back, detokenizing, stop checks, scheduling) overlaps the stages' work.
Feed and host token buffers alternate between two halves per slot, so a micro-batch never
overwrites tokens that a launched one has still to read.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from graphrt.batch import StepMetadata
from graphrt.capture.graphs import StageGraphs
from graphrt.pipeline import Pipeline
from graphrt.profiling.nvtx import Ranges
from graphrt.profiling.timeline import Timeline, mark
from graphrt.sampling import Sampler, host_to_device
from graphrt.scheduler import ScheduledStep
from graphrt.sequence import Sequence
from graphrt.streams import make_stream


@dataclass
class MicroBatch:
    id: int  # increases in launch order, which is also the order micro-batches finish in
    slot: int
    step: ScheduledStep
    sample_rows: list[int]  # rows of step.seqs that get a token from this micro-batch
    launched_at: float
    token_base: int  # where its sampled tokens go in the ring's feed and host token buffer
    reads_feed: bool  # some input tokens come from the feed (see Sequence.token_at)
    done: object = None  # the last stage's event
    bucket: int | None = None
    busy_events: list = field(default_factory=list)  # CUDA: (stage, start, end) events of its work

    @property
    def sampled_seqs(self) -> list[Sequence]:
        return [self.step.seqs[i] for i in self.sample_rows]


@dataclass
class RingSlot:
    index: int
    recv: list[torch.Tensor | None]  # per stage: activations from the previous stage (None on stage 0)
    in_flight: list[MicroBatch] = field(default_factory=list)  # oldest first; they run one after another
    launches: int = 0


@dataclass
class Ring:
    pipeline: Pipeline
    graphs: list[StageGraphs]
    sampler: Sampler
    num_slots: int
    max_tokens: int  # per micro-batch: max(prefill chunk, largest bucket)
    max_per_slot: int = 1  # micro-batches a slot may hold: 2 with async scheduling
    timeline: Timeline | None = None
    ranges: Ranges = field(default_factory=Ranges)
    slots: list[RingSlot] = field(init=False)
    _ids: itertools.count = field(init=False, default_factory=itertools.count)

    def __post_init__(self) -> None:
        stages = self.pipeline.stages
        self.busy_s = [0.0] * len(stages)  # seconds each local stage has spent on micro-batches
        self.streams = self._make_streams()
        self.slots = [
            RingSlot(
                index=k,
                recv=[None]
                + [torch.empty(self.max_tokens, s.cfg.hidden_size, dtype=s.dtype, device=s.device) for s in stages[1:]],
            )
            for k in range(self.num_slots)
        ]
        # Two halves per slot (see the module docstring), indexed by MicroBatch.token_base.
        size = self.num_slots * 2 * self.max_tokens
        self.host_tokens = torch.zeros(size, dtype=torch.int64, pin_memory=stages[-1].device.type == "cuda")
        self.feed = self._make_feed()

    def _make_feed(self) -> torch.Tensor:
        """Where stage 0 reads the tokens of a micro-batch not yet read back: on its device."""
        first = self.pipeline.stages[0].device
        return self.host_tokens if first.type == "cpu" else torch.zeros_like(self.host_tokens, device=first)

    def _make_streams(self) -> list:
        return [make_stream(stage.device, f"graphrt-stage{stage.index}") for stage in self.pipeline.stages]

    def reset(self) -> None:
        """After a stage failure: fresh streams (a CPU worker keeps its error) and every slot free."""
        for stream in self.streams:
            stream.close()
        self.streams = self._make_streams()
        for slot in self.slots:
            slot.in_flight.clear()

    def open_slots(self) -> list[RingSlot]:
        """The slots that can take a micro-batch, in the order to try them: empty ones first, then
        the one whose micro-batch in flight was launched first (it is the first to finish)."""
        def order(slot: RingSlot) -> tuple[int, int]:
            return len(slot.in_flight), slot.in_flight[-1].id if slot.in_flight else 0

        return sorted((slot for slot in self.slots if len(slot.in_flight) < self.max_per_slot), key=order)

    def launch(
        self, slot: RingSlot, step: ScheduledStep, token_ids: torch.Tensor, meta: StepMetadata, now: float,
        producers: list[MicroBatch] | None = None,
    ) -> MicroBatch:
        """Enqueue one micro-batch on every stage; returns at once (CUDA) or after queuing (CPU).

        `producers` are the micro-batches in flight whose tokens this one reads from the feed.
        """
        sample_rows = [i for i, seq in enumerate(step.seqs) if not seq.in_prefill]
        bucket = None if step.is_prefill else self.graphs[0].plan.bucket_for(len(step.seqs))
        token_base = (2 * slot.index + slot.launches % 2) * self.max_tokens
        producers = producers or []
        mb = MicroBatch(
            next(self._ids), slot.index, step, sample_rows, now, token_base=token_base, reads_feed=bool(producers), bucket=bucket
        )
        params = [seq.params for seq in mb.sampled_seqs]
        generators = [seq.generator for seq in mb.sampled_seqs]
        # Stage 0 starts once the slot's earlier micro-batch has left the last stage (its buffers
        # are free) and the tokens it reads are in the feed.
        waits = {id(earlier): earlier for earlier in [*slot.in_flight, *producers]}
        for earlier in waits.values():
            self._wait_on_stage0(earlier)
        event = None
        for index, stream in enumerate(self.streams):
            if event is not None:
                stream.wait_event(event)
            stream.submit(lambda i=index: self._run_stage(i, slot, mb, token_ids, meta, params, generators))
            event = stream.record()
        mb.done = event
        slot.in_flight.append(mb)
        slot.launches += 1
        return mb

    def _wait_on_stage0(self, earlier: MicroBatch) -> None:
        self.streams[0].wait_event(earlier.done)

    def read_tokens(self, mb: MicroBatch) -> list[int]:
        """The sampled token ids of a micro-batch whose event has passed."""
        return self.host_tokens[mb.token_base : mb.token_base + len(mb.sample_rows)].tolist()

    def retire(self, mb: MicroBatch) -> None:
        """The host has read `mb` back: its slot may take another micro-batch."""
        self.slots[mb.slot].in_flight.remove(mb)

    def _run_stage(self, index, slot, mb, token_ids, meta, params, generators) -> None:
        stage, cache = self.pipeline.stages[index], self.pipeline.caches[index]
        num_tokens = token_ids.shape[0]
        kind = "prefill" if mb.step.is_prefill else "decode"
        started = self.timeline.begin(stage.device) if self.timeline else None
        busy_from = mark(stage.device)
        if mb.step.is_prefill:
            work = self.ranges.prefill(index, num_tokens)
        else:
            work = self.ranges.stage(index, mb.slot, mb.bucket)
        with work:
            x = self._input_ids(token_ids, mb).to(stage.device, non_blocking=True) if index == 0 else slot.recv[index][:num_tokens]
            stage_meta = meta.to(stage.device)
            if mb.step.is_prefill:
                out = stage(x, stage_meta, cache)
            else:
                out = self.graphs[index].run(x, stage_meta)
            if not stage.is_last:
                with self.ranges.transfer(index):
                    slot.recv[index + 1][:num_tokens].copy_(out, non_blocking=True)
            elif mb.sample_rows:
                logits = out if len(mb.sample_rows) == out.shape[0] else out[host_to_device(mb.sample_rows, torch.int64, out.device)]
                with self.ranges.sample():
                    token_ids_out = self.sampler(logits, params, generators)
                rows = slice(mb.token_base, mb.token_base + len(mb.sample_rows))
                if self.feed is not self.host_tokens:
                    self.feed[rows].copy_(token_ids_out, non_blocking=True)
                self.host_tokens[rows].copy_(token_ids_out, non_blocking=True)
        self._busy_end(index, stage.device, busy_from, mb)
        if self.timeline:
            self.timeline.end(
                stage.device, started, stage=index, slot=mb.slot, micro_batch=mb.id, kind=kind,
                rows=len(mb.step.seqs), bucket=mb.bucket,
            )

    def _input_ids(self, token_ids: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        """Stage 0's token ids, with each -1 - i replaced by the token at feed[i]."""
        if not mb.reads_feed:
            return token_ids
        ids = token_ids.to(self.feed.device, non_blocking=True)
        return torch.where(ids < 0, self.feed[(-1 - ids).clamp(min=0)], ids)

    # Always-on per-stage busy time, for /metrics: a clock read in the CPU worker, or a pair of
    # CUDA events read back with the micro-batch (never a host clock around asynchronous work).

    def _busy_end(self, index: int, device: torch.device, began, mb: MicroBatch) -> None:
        ended = mark(device)
        if device.type == "cuda":
            mb.busy_events.append((index, began, ended))
        else:
            self.busy_s[index] += ended - began

    @property
    def stage_busy_s(self) -> list[float]:
        """Seconds each stage has spent on micro-batches (all stages are local here)."""
        return list(self.busy_s)

    def collect_busy(self, mb: MicroBatch) -> None:
        """Add a finished micro-batch's CUDA-timed stage work to `busy_s`."""
        for index, began, ended in mb.busy_events:
            self.busy_s[index] += began.elapsed_time(ended) / 1000
        mb.busy_events.clear()

    def close(self) -> None:
        for stream in self.streams:
            stream.close()
