"""The micro-batch ring: L = pp + depth slots moving through the stages at once.

Each slot owns, on every stage, the buffer its activations arrive in, so micro-batches running at
once never share memory. Launching a micro-batch enqueues, stage by stage on that stage's stream:
wait for the previous stage's event, run the stage (the bucket's graph for decode, eager for
prefill), copy the output into the next stage's receive buffer for this slot, record an event.
The last stage processes the logits as the requests ask (penalties, bias, masks: a `LogitsPlan`,
graphrt.runtime.logits_plan), samples on device and writes the token ids twice: into the token feed on stage 0's
device, where the next step of those sequences reads them, and into pinned host memory, which the
host reads once the micro-batch's event has passed.

Async scheduling: a slot holds up to `max_per_slot` micro-batches. The second one is launched before
the first is read back; its stage 0 waits (on the device, not the host) for the first to leave
the last stage, then takes its input tokens from the feed. The host so decides a whole ring ahead
and its turnaround (read-back, detokenizing, stop checks, scheduling) overlaps the stages' work.
Feed and host token buffers alternate between two halves per slot, so a micro-batch never
overwrites tokens that a launched one has still to read.

The engine sees `launch(slot, step)` and `poll(block)`: the ring builds the step's tensors, knows
what is in flight (each slot's micro-batches, oldest first) and where each sequence's token still
on the device lands in the feed, and hands back the oldest finished micro-batch with its tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from graphrt.capture.graphs import StageGraphs
from graphrt.model import SCRATCH_BLOCK
from graphrt.model.batch import StepMetadata
from graphrt.profiling.nvtx import Ranges
from graphrt.profiling.timeline import Timeline, mark
from graphrt.profiling.timing import median_seconds
from graphrt.runtime.logits_plan import LogitsPlan, plan_logits
from graphrt.runtime.logprobs import LogprobPlan, plan_logprobs, score_rows
from graphrt.runtime.pipeline import Pipeline
from graphrt.runtime.sampler import Sampler
from graphrt.runtime.step import Row, ScheduledStep, feed_index, feed_ref, is_feed_ref
from graphrt.runtime.streams import CpuStream, make_stream
from graphrt.runtime.transfers import host_to_device


@dataclass
class MicroBatch:
    """A scheduled step in the ring; `token_ids` is set when the ring hands it back (`Ring.poll`)."""

    step: ScheduledStep
    slot: int
    launched_at: float
    token_base: int  # where its sampled tokens go in the ring's feed and host token buffer
    reads_feed: bool  # some input tokens come from the feed (see feed_ref)
    done: object = None  # the last stage's event
    bucket: int | None = None
    busy_events: list = field(default_factory=list)  # CUDA: (stage, start, end) events of its work
    mask_wait_s: float = 0.0  # CPU: the last stage's wait for masks made after launch (graphrt.runtime.logits_plan.PendingMasks)
    token_ids: list[int] | None = None  # one per sampled token (a verify row's 1 + drafts), once read back
    logprobs: LogprobPlan | None = None  # what its last stage scores, for the requests that ask
    logits_plan: LogitsPlan | None = None  # what its last stage does to the logits first, for the requests that ask
    released: list[int] = field(default_factory=list)  # request ids whose state on the last stage can go

    @property
    def id(self) -> int:
        return self.step.id

    @property
    def sample_rows(self) -> list[int]:
        return self.step.sample_rows

    @property
    def sampled_seqs(self) -> list[Row]:
        return self.step.sampled_seqs


def build_inputs(
    step: ScheduledStep, block_size: int, feed_indices: dict[int, int] | None = None, pin: bool = False,
    extra_logits_rows: list[int] = (),
) -> tuple[torch.Tensor, StepMetadata]:
    """Token ids and metadata of a step on the host; the pipeline moves them to each stage. A token
    not read back yet is given as a feed reference, from `feed_indices` (request id -> feed index).
    A prompt chunk has a row per sequence and the last stage computes logits for each sequence's
    last token, then for `extra_logits_rows` (prompt rows to score, see graphrt.runtime.logprobs).
    A decode step has a row per token: a verify row's newest token and drafts are rows of their
    own, each with its position, its context up to itself and its sequence's block table, so the
    decode kernels and graphs run them as they are and give logits at every token.

    `pin` puts them in page-locked memory, so the copies to a GPU are truly asynchronous (from
    pageable memory the driver may wait for the stream, and the host would block).
    """
    token_ids, positions, slots, seq_lens, last_rows, row_seqs = [], [], [], [], [], []
    for row, (seq, start, query_len) in enumerate(zip(step.seqs, step.starts, step.query_lens)):
        drafts = step.draft_ids[row] if step.draft_ids else ()
        for offset, pos in enumerate(range(start, start + query_len)):
            token = drafts[offset - 1] if offset and drafts else seq.token_at(pos)
            token_ids.append(token if token is not None else feed_ref(feed_indices[seq.request_id]))
            positions.append(pos)
            slots.append(seq.block_ids[pos // block_size] * block_size + pos % block_size)
            if not step.is_prefill:
                seq_lens.append(pos + 1)
                row_seqs.append(seq)
        if step.is_prefill:
            seq_lens.append(start + query_len)
            row_seqs.append(seq)
            last_rows.append(len(token_ids) - 1)
    if not step.is_prefill:
        last_rows = list(range(len(token_ids)))
    # Only the blocks the context reaches so far (a sequence may hold one more, or a preempted
    # one's recompute may be under way): attention reads no further.
    live = [-(-seq_len // block_size) for seq_len in seq_lens]
    width = max(live)
    tables = []
    for seq, blocks in zip(row_seqs, live):
        tables += seq.block_ids[:blocks]
        tables += [SCRATCH_BLOCK] * (width - blocks)
    # One tensor construction per micro-batch, then views: this runs on the host every tick.
    logits_rows = last_rows + list(extra_logits_rows)
    flat = torch.tensor(token_ids + positions + slots + seq_lens + logits_rows + tables, dtype=torch.int64)
    if pin:
        flat = flat.pin_memory()
    num_tokens, num_rows = len(token_ids), len(seq_lens)
    rows_from = 3 * num_tokens  # after token ids, positions and slots: seq lens, logits rows, tables
    tables_from = rows_from + num_rows + len(logits_rows)
    meta = StepMetadata(
        positions=flat[num_tokens : 2 * num_tokens],
        slot_mapping=flat[2 * num_tokens : rows_from],
        block_tables=flat[tables_from:].view(num_rows, width),
        seq_lens=flat[rows_from : rows_from + num_rows],
        logits_indices=flat[rows_from + num_rows : tables_from],
        seq_lens_host=seq_lens,
        query_lens=list(step.query_lens) if step.is_prefill else None,
    )
    return flat[:num_tokens], meta


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
    sampler: Sampler | None  # None on rank 0 of stage processes, where the last rank samples (unless pp is 1: --ep)
    num_slots: int
    max_tokens: int  # per micro-batch: max(prefill chunk, largest bucket)
    block_size: int
    max_per_slot: int = 1  # micro-batches a slot may hold: 2 with async scheduling
    timeline: Timeline | None = None
    ranges: Ranges = field(default_factory=Ranges)
    pin: bool = False  # build inputs in page-locked memory (a CUDA stage 0)
    eos_ids: frozenset[int] = frozenset()  # masked with a request's stop tokens before its min_tokens
    slots: list[RingSlot] = field(init=False)
    # Tokens still on the device, by request id: the micro-batch sampling it, and its index in the feed.
    _producers: dict[int, MicroBatch] = field(init=False, default_factory=dict)
    _feed_indices: dict[int, int] = field(init=False, default_factory=dict)
    # Requests with state on the last stage (see _holds_state), until they end, and the ended ones
    # whose release was lost with a failed micro-batch.
    _holders: dict[int, Row] = field(init=False, default_factory=dict)
    _unreleased: list[int] = field(init=False, default_factory=list)

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
        """One per stage, each with its kernel set's hook (a fresh thread needs its own, e.g. its team)."""
        return [
            make_stream(stage.device, f"graphrt-stage{stage.index}", stage.ops.stream_hook) for stage in self.pipeline.stages
        ]

    @property
    def defers_masks(self) -> bool:
        """Whether a constrained row may be launched before its newest token is back, its mask made
        after the read-back (graphrt.runtime.logits_plan.PendingMasks): where the last stage samples
        on a worker thread that can wait for it, not on the host thread that makes it (a GPU)."""
        return self.sampler is not None and isinstance(self.streams[-1], CpuStream)

    def fill_pending_masks(self) -> None:
        """After a read-back: the masks of micro-batches in flight that waited for its tokens."""
        for mb in self.in_flight:
            pending = mb.logits_plan.pending if mb.logits_plan is not None else None
            if pending is not None and not pending.ready.is_set():
                pending.try_fill(mb.logits_plan)

    def release_pending_masks(self) -> None:
        """Let every stage waiting for a mask go on with all tokens allowed: the micro-batches in
        flight are dropped (a stage or a read-back failed, or the ring closes)."""
        for mb in self.in_flight:
            if mb.logits_plan is not None and mb.logits_plan.pending is not None:
                mb.logits_plan.pending.release(mb.logits_plan)

    def reset(self, cause: str) -> None:
        """After a stage failure (`cause`): every micro-batch in flight is dropped and every slot is
        free. Waits for the stage workers to drain first, so no late write lands in a freed block;
        the streams are fresh (a CPU worker keeps its error)."""
        self.release_pending_masks()  # a worker waiting for a mask would never drain
        for stream in self.streams:
            stream.close()
        self.streams = self._make_streams()
        self._forget_in_flight()

    def _forget_in_flight(self) -> None:
        for mb in self.in_flight:  # what they were to release is released by the next one (twice does no harm)
            self._unreleased += mb.released
        for slot in self.slots:
            slot.in_flight.clear()
        self._producers.clear()
        self._feed_indices.clear()

    @property
    def in_flight(self) -> list[MicroBatch]:
        """Every micro-batch launched and not handed back, in launch order."""
        return sorted((mb for slot in self.slots for mb in slot.in_flight), key=lambda mb: mb.id)

    @property
    def busy(self) -> bool:
        return any(slot.in_flight for slot in self.slots)

    def open_slots(self) -> list[RingSlot]:
        """The slots that can take a micro-batch, in the order to try them: empty ones first, then
        the one whose micro-batch in flight was launched first (it is the first to finish)."""
        def order(slot: RingSlot) -> tuple[int, int]:
            return len(slot.in_flight), slot.in_flight[-1].id if slot.in_flight else 0

        return sorted((slot for slot in self.slots if len(slot.in_flight) < self.max_per_slot), key=order)

    def launch(self, slot: RingSlot, step: ScheduledStep) -> MicroBatch:
        """Build the step's tensors and enqueue it on every stage; returns at once (CUDA) or after
        queuing (CPU)."""
        logprobs = plan_logprobs(step)
        extra_rows = logprobs.prompt_rows if logprobs is not None else []
        token_ids, meta = build_inputs(step, self.block_size, self._feed_indices, self.pin, extra_rows)
        # The micro-batches in flight whose tokens this one reads from the feed.
        producers = {}
        for seq, start in zip(step.seqs, step.starts):
            if start >= seq.num_tokens:
                producer = self._producers[seq.request_id]
                producers[id(producer)] = producer
        bucket = None if step.is_prefill else self.graphs[0].plan.bucket_for(step.num_tokens)
        token_base = (2 * slot.index + slot.launches % 2) * self.max_tokens
        mb = MicroBatch(
            step, slot.index, time.perf_counter(), token_base=token_base, reads_feed=bool(producers), bucket=bucket,
            logprobs=logprobs, logits_plan=plan_logits(step, self.eos_ids), released=self._released(step),
        )
        if mb.logits_plan is not None and mb.logits_plan.pending is not None and not self.defers_masks:
            raise RuntimeError("a constrained row was launched before its token was back, on a ring that cannot wait for its mask")
        if logprobs is not None:
            logprobs.allocate(pin=self.pipeline.stages[-1].device.type == "cuda")
        self._enqueue(slot, mb, token_ids, meta, list(producers.values()))
        for row, seq in zip(step.sample_rows, mb.sampled_seqs):
            if not step.num_drafts(row):  # a verify row's next input is known only once read back
                self._producers[seq.request_id], self._feed_indices[seq.request_id] = mb, token_base + row
        return mb

    def _holds_state(self, params) -> bool:
        """Whether a request keeps state on the last stage between its steps: a token history."""
        return params.tracks_history

    def _released(self, step: ScheduledStep) -> list[int]:
        """The requests whose state on the last stage can go: those that ended since the last launch.
        The last stage runs micro-batches in launch order, so every one of theirs is done by then."""
        for seq in step.sampled_seqs:
            if self._holds_state(seq.params):
                self._holders[seq.request_id] = seq
        released = [request_id for request_id, seq in self._holders.items() if seq.finished]
        for request_id in released:
            del self._holders[request_id]
        released, self._unreleased = self._unreleased + released, []
        return released

    def _enqueue(
        self, slot: RingSlot, mb: MicroBatch, token_ids: torch.Tensor, meta: StepMetadata, producers: list[MicroBatch]
    ) -> None:
        # One entry per token to sample (a verify row's 1 + drafts share its params and generator).
        counts = mb.step.sample_counts
        params = [seq.params for seq, count in zip(mb.sampled_seqs, counts) for _ in range(count)]
        generators = [seq.generator for seq, count in zip(mb.sampled_seqs, counts) for _ in range(count)]
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

    def _wait_on_stage0(self, earlier: MicroBatch) -> None:
        self.streams[0].wait_event(earlier.done)

    def poll(self, block: bool) -> MicroBatch | None:
        """The oldest micro-batch with its token ids read back, once it is done (waiting for it when
        `block`), or None. Raises what a stage raised while running it (it stays in flight).

        Micro-batches pass every stage in launch order, so the oldest is always the first done.
        """
        busy = [slot.in_flight[0] for slot in self.slots if slot.in_flight]
        oldest = min(busy, key=lambda mb: mb.id) if busy else None
        if oldest is not None and (block or oldest.done.query()):
            waited_from = self.timeline.now() if self.timeline else 0.0
            oldest.done.synchronize()
            self.collect_busy(oldest)
            if self.timeline:
                self.timeline.record_wait(waited_from, self.timeline.now())
            num_sampled = sum(oldest.step.sample_counts)
            oldest.token_ids = self.host_tokens[oldest.token_base : oldest.token_base + num_sampled].tolist()
            self.slots[oldest.slot].in_flight.remove(oldest)  # the slot may take another micro-batch
            for seq in oldest.sampled_seqs:
                if self._producers.get(seq.request_id) is oldest:
                    del self._producers[seq.request_id], self._feed_indices[seq.request_id]
        else:
            oldest = None
        if self.timeline:
            self.timeline.resolve()
        return oldest

    def _run_stage(self, index, slot, mb, token_ids, meta, params, generators) -> None:
        stage, cache = self.pipeline.stages[index], self.pipeline.caches[index]
        num_tokens = token_ids.shape[0]
        kind = "prefill" if mb.step.is_prefill else "verify" if mb.step.is_verify else "decode"
        started = self.timeline.begin(stage.device) if self.timeline else None
        busy_from = mark(stage.device)
        if mb.step.is_prefill:
            work = self.ranges.prefill(index, num_tokens)
        elif mb.step.is_verify:
            work = self.ranges.verify(index, mb.slot, num_tokens)
        else:
            work = self.ranges.stage(index, mb.slot, mb.bucket)
        with work:
            x = self._input_ids(token_ids, mb).to(stage.device, non_blocking=True) if index == 0 else slot.recv[index][:num_tokens]
            stage_meta = meta.to(stage.device)
            if mb.step.is_prefill:
                out = stage(x, stage_meta, cache)
            else:
                out = self.graphs[index].run(x, stage_meta)
            stage.publish_expert_tokens()
            if not stage.is_last:
                with self.ranges.transfer(index):
                    slot.recv[index + 1][:num_tokens].copy_(out, non_blocking=True)
            else:
                self._sample(mb, out, params, generators)
        self._busy_end(index, stage.device, busy_from, mb)
        if self.timeline:
            self.timeline.end(
                stage.device, started, stage=index, slot=mb.slot, micro_batch=mb.id, kind=kind,
                rows=len(mb.step.seqs), bucket=mb.bucket,
            )

    def _sample(self, mb: MicroBatch, out: torch.Tensor, params, generators) -> None:
        """On the last stage: sample the rows that get a token, score what `mb.logprobs` asks for."""
        if mb.released:
            self.sampler.release(mb.released)
        logits = token_ids_out = None
        # A decode step samples at each of its tokens (a verify row's drafts too), which are its
        # logits rows in order; a prompt chunk at the last token of each row that samples.
        num_sampled = sum(mb.step.sample_counts)
        if num_sampled:
            every_row = num_sampled == out.shape[0]  # sampled rows are distinct and in order: all of them
            logits = out if every_row else out[host_to_device(mb.sample_rows, torch.int64, out.device)]
            if mb.logits_plan is not None and mb.logits_plan.pending is not None:
                waited_from = time.perf_counter()
                mb.logits_plan.pending.ready.wait()  # masks made after an earlier micro-batch's read-back
                mb.mask_wait_s = time.perf_counter() - waited_from  # idle, not stage work
            with self.ranges.sample():
                token_ids_out = self.sampler(logits, params, generators, mb.logits_plan)
            rows = slice(mb.token_base, mb.token_base + num_sampled)
            if self.feed is not self.host_tokens:
                self.feed[rows].copy_(token_ids_out, non_blocking=True)
            self.host_tokens[rows].copy_(token_ids_out, non_blocking=True)
        plan = mb.logprobs
        if plan is not None:
            values, top_ids = score_rows(
                out, logits, token_ids_out, plan.sampled, len(mb.step.seqs), plan.prompt_targets, plan.num_top
            )
            plan.values.copy_(values, non_blocking=True)
            plan.top_ids.copy_(top_ids, non_blocking=True)

    def _input_ids(self, token_ids: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        """Stage 0's token ids, with each feed reference replaced by the token in the feed."""
        if not mb.reads_feed:
            return token_ids
        ids = token_ids.to(self.feed.device, non_blocking=True)
        return torch.where(is_feed_ref(ids), self.feed[feed_index(ids).clamp(min=0)], ids)

    def time_decode_steps(self, repeats: int = 3) -> dict[int, float]:
        """Bucket -> seconds a decode micro-batch of that bucket takes through the local stages,
        one stage after another on their own streams (the median of `repeats`, after a warm-up),
        for speculative decoding to weigh a verify step's tokens against (graphrt.engine.drafter).
        Run before any request: every row is padding, so the graphs touch only the scratch block."""
        if self.busy:
            raise RuntimeError("time_decode_steps while micro-batches are in flight would race the stage workers")
        seconds = {}
        for bucket in self.graphs[0].plan.sizes:
            total = 0.0
            for stream, graphs in zip(self.streams, self.graphs):
                graph = graphs.graphs[bucket]
                graph.inputs.pad()

                def replay(stream=stream, graph=graph) -> None:
                    stream.submit(graph.replay)
                    stream.record().synchronize()

                total += median_seconds(replay, repeats)
            seconds[bucket] = total
        return seconds

    # Always-on per-stage busy time, for /metrics: a clock read in the CPU worker, or a pair of
    # CUDA events read back with the micro-batch (never a host clock around asynchronous work).

    def _busy_end(self, index: int, device: torch.device, began, mb: MicroBatch) -> None:
        ended = mark(device)
        if device.type == "cuda":
            mb.busy_events.append((index, began, ended))
        else:
            self.busy_s[index] += ended - began - mb.mask_wait_s

    @property
    def stage_busy_s(self) -> list[float]:
        """Seconds each stage has spent on micro-batches (all stages are local here)."""
        return list(self.busy_s)

    @property
    def stage_expert_tokens(self) -> list[list[int]]:
        """Each stage's tokens per expert ([] for a dense stage), as of its last micro-batch."""
        return [stage.seen_expert_tokens() for stage in self.pipeline.stages]

    @property
    def stage_expert_reads(self) -> list[int]:
        """The experts each stage's decode steps have read (0 for a dense stage), as of its last micro-batch."""
        return [stage.seen_expert_reads() for stage in self.pipeline.stages]

    def collect_busy(self, mb: MicroBatch) -> None:
        """Add a finished micro-batch's CUDA-timed stage work to `busy_s`."""
        for index, began, ended in mb.busy_events:
            self.busy_s[index] += began.elapsed_time(ended) / 1000
        mb.busy_events.clear()

    def close(self) -> None:
        self.release_pending_masks()  # a worker waiting for a mask would sit out its join timeout
        for stream in self.streams:
            stream.close()
