"""The micro-batch ring: L = pp + depth slots moving through the stages at once.

Each slot owns, on every stage, the buffer its activations arrive in, and a host buffer for its
sampled tokens, so micro-batches in flight never share memory. Launching a micro-batch enqueues,
stage by stage on that stage's stream: wait for the previous stage's event, run the stage (the
bucket's graph for decode, eager for prefill), copy the output into the next stage's receive
buffer for this slot, record an event. The last stage samples on device and copies the token ids
to the slot's host buffer; the host reads them when the slot's event has passed.
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
    id: int
    slot: int
    step: ScheduledStep
    sample_rows: list[int]  # rows of step.seqs that get a token from this micro-batch
    launched_at: float
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
    tokens: torch.Tensor  # host buffer for sampled token ids
    micro_batch: MicroBatch | None = None


@dataclass
class Ring:
    pipeline: Pipeline
    graphs: list[StageGraphs]
    sampler: Sampler
    num_slots: int
    max_tokens: int  # per micro-batch: max(prefill chunk, largest bucket)
    timeline: Timeline | None = None
    ranges: Ranges = field(default_factory=Ranges)
    slots: list[RingSlot] = field(init=False)
    _ids: itertools.count = field(init=False, default_factory=itertools.count)

    def __post_init__(self) -> None:
        stages = self.pipeline.stages
        self.busy_s = [0.0] * len(stages)  # seconds each local stage has spent on micro-batches
        self.streams = self._make_streams()
        pinned = stages[-1].device.type == "cuda"
        self.slots = [
            RingSlot(
                index=k,
                recv=[None]
                + [torch.empty(self.max_tokens, s.cfg.hidden_size, dtype=s.dtype, device=s.device) for s in stages[1:]],
                tokens=torch.zeros(self.max_tokens, dtype=torch.int64, pin_memory=pinned),
            )
            for k in range(self.num_slots)
        ]

    def _make_streams(self) -> list:
        return [make_stream(stage.device, f"graphrt-stage{stage.index}") for stage in self.pipeline.stages]

    def reset(self) -> None:
        """After a stage failure: fresh streams (a CPU worker keeps its error) and every slot free."""
        for stream in self.streams:
            stream.close()
        self.streams = self._make_streams()
        for slot in self.slots:
            slot.micro_batch = None

    def free_slot(self) -> RingSlot | None:
        return next((slot for slot in self.slots if slot.micro_batch is None), None)

    def launch(self, slot: RingSlot, step: ScheduledStep, token_ids: torch.Tensor, meta: StepMetadata, now: float) -> MicroBatch:
        """Enqueue one micro-batch on every stage; returns at once (CUDA) or after queuing (CPU)."""
        sample_rows = [i for i, seq in enumerate(step.seqs) if not seq.in_prefill]
        bucket = None if step.is_prefill else self.graphs[0].plan.bucket_for(len(step.seqs))
        mb = MicroBatch(next(self._ids), slot.index, step, sample_rows, now, bucket=bucket)
        params = [seq.params for seq in mb.sampled_seqs]
        generators = [seq.generator for seq in mb.sampled_seqs]
        event = None
        for index, stream in enumerate(self.streams):
            if event is not None:
                stream.wait_event(event)
            stream.submit(lambda i=index: self._run_stage(i, slot, mb, token_ids, meta, params, generators))
            event = stream.record()
        mb.done = event
        slot.micro_batch = mb
        return mb

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
            x = token_ids.to(stage.device, non_blocking=True) if index == 0 else slot.recv[index][:num_tokens]
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
                slot.tokens[: len(mb.sample_rows)].copy_(token_ids_out, non_blocking=True)
        self._busy_end(index, stage.device, busy_from, mb)
        if self.timeline:
            self.timeline.end(
                stage.device, started, stage=index, slot=mb.slot, micro_batch=mb.id, kind=kind,
                rows=len(mb.step.seqs), bucket=mb.bucket,
            )

    # Always-on per-stage busy time, for /metrics: a clock read in the CPU worker, or a pair of
    # CUDA events read back with the micro-batch (never a host clock around asynchronous work).

    def _busy_end(self, index: int, device: torch.device, began, mb: MicroBatch) -> None:
        ended = mark(device)
        if device.type == "cuda":
            mb.busy_events.append((index, began, ended))
        else:
            self.busy_s[index] += ended - began

    def collect_busy(self, mb: MicroBatch) -> None:
        """Add a finished micro-batch's CUDA-timed stage work to `busy_s`."""
        for index, began, ended in mb.busy_events:
            self.busy_s[index] += began.elapsed_time(ended) / 1000
        mb.busy_events.clear()

    def close(self) -> None:
        for stream in self.streams:
            stream.close()
