"""How many KV cache blocks fit on the GPUs, once what serving needs besides the cache is measured.

The cache is allocated before the graphs are recorded (they hold its addresses), and it would
take 85% of free memory before the graph pools, the ring's buffers and a prefill chunk's
activations exist: the first long prompt, or capture itself, would then run out of memory. As vLLM
profiles a forward pass (and its graphs) before sizing its cache, `measure_headroom` runs the
stages once on a small probe cache, eagerly, over what they will run: a full prefill chunk, each
stage's decode forward at the largest batch over a table as wide as a graph's, and the sampler on
that many rows, each with penalties and min_p (so the token histories of that many requests, which
stay, are in its peak). Then the probe is freed and the cache takes its share of what is left.

What a device must keep free besides the cache:
- graph pools, which stay: about each stage's decode peak at its largest bucket (a stage's graphs
  share one pool, which the largest bucket's working set sizes), summed over the device's stages;
  nothing with the eager backend, where that peak is transient like the others;
- the ring's receive buffers and token feed, which stay (exact, from their shapes);
- the largest transient peak: a prefill chunk, an eager decode step, or sampling.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphrt.capture.graphs import StaticInputs
from graphrt.errors import GraphrtError
from graphrt.model.batch import StepMetadata
from graphrt.runtime.logits_plan import LogitsPlan
from graphrt.runtime.pipeline import Pipeline
from graphrt.runtime.sampler import Sampler
from graphrt.sampling_params import SamplingParams

GPU_MEMORY_FRACTION = 0.85  # of the free memory after the weights, less the measured headroom


@dataclass
class Headroom:
    """Bytes one device keeps free for what serving allocates besides the KV cache."""

    graph_pools: int = 0  # persistent
    ring_buffers: int = 0  # persistent
    transient: int = 0  # the largest peak of one prefill chunk, decode step or sampling

    @property
    def total(self) -> int:
        return self.graph_pools + self.ring_buffers + self.transient


def peak_bytes(device: torch.device, run) -> int:
    """What `run()` allocated on `device` at its peak, beyond what was allocated before it."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    result = run()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del result
    return max(0, peak)


def measure_headroom(
    pipeline: Pipeline, *, block_size: int, max_model_len: int, max_batch: int, prefill_chunk_size: int,
    num_slots: int, max_tokens: int, use_cuda_graphs: bool,
) -> dict[torch.device, Headroom]:
    """Run the stages on a probe cache (left freed) and return each device's headroom."""
    stages = pipeline.stages
    chunk = min(prefill_chunk_size, max_model_len)
    probe_blocks = 1 + max(-(-chunk // block_size), 1)  # the scratch block, then one prompt's blocks
    pipeline.allocate_kv(probe_blocks, block_size)
    headroom = {stage.device: Headroom() for stage in stages}
    try:
        for index, stage in enumerate(stages):
            cache, room = pipeline.caches[index], headroom[stage.device]
            if index > 0:  # a receive buffer per slot, as the ring makes them
                room.ring_buffers += num_slots * max_tokens * stage.cfg.hidden_size * stage.dtype.itemsize
            # Decode at the largest batch over a graph-wide table, as capture records it.
            inputs = StaticInputs.allocate(stage, max_batch, -(-max_model_len // block_size))
            decode = peak_bytes(stage.device, lambda: stage(inputs.x, inputs.meta, cache))
            inputs = None  # the probe's tensors go before the next stage's
            if use_cuda_graphs:
                room.graph_pools += decode
            else:
                room.transient = max(room.transient, decode)
        headroom[stages[0].device].ring_buffers += num_slots * 2 * max_tokens * 8  # the token feed (int64, two halves per slot)
        for device, bytes_ in _prefill_peaks(pipeline, chunk, block_size).items():
            headroom[device].transient = max(headroom[device].transient, bytes_)
        last = stages[-1]
        if last.is_last:  # rank 0 of stage processes samples only when it holds the last stage (pp 1, --ep)
            logits = torch.zeros(max_batch, last.cfg.vocab_size, dtype=last.dtype, device=last.device)
            sampler = Sampler(last.device, seed=0)
            random_rows = [SamplingParams(temperature=1.0, top_p=0.9, top_k=50)] * max_batch  # sorts every row
            plan = penalize_every_row(max_batch)
            sampling = peak_bytes(last.device, lambda: sampler(logits, random_rows, [None] * max_batch, plan))
            headroom[last.device].transient = max(headroom[last.device].transient, sampling)
    finally:
        pipeline.caches = []
        torch.cuda.empty_cache()  # the probe's memory goes back to the device before free memory is read
    return headroom


def penalize_every_row(num_rows: int) -> LogitsPlan:
    """A plan that starts a token history for each of `num_rows` requests and applies every penalty
    and min_p to them: the most a sampling step allocates."""
    rows = list(range(num_rows))
    return LogitsPlan(
        history_entries=rows, history_requests=rows, history_priors=[0] * num_rows, init_requests=rows,
        presence=[0.5] * num_rows, frequency=[0.5] * num_rows, repetition=[1.1] * num_rows, min_p=[0.05] * num_rows,
    )


def _prefill_peaks(pipeline: Pipeline, chunk: int, block_size: int) -> dict[torch.device, int]:
    """One prompt of `chunk` tokens through every stage: each stage's peak on its device."""
    positions = torch.arange(chunk)
    table = torch.arange(1, 1 + -(-chunk // block_size))[None, :]  # (1, blocks): past the scratch block
    meta = StepMetadata(
        positions=positions,
        slot_mapping=table[0, positions // block_size] * block_size + positions % block_size,
        block_tables=table,
        seq_lens=torch.tensor([chunk]),
        logits_indices=torch.tensor([chunk - 1]),
        seq_lens_host=[chunk],
        query_lens=[chunk],
    )
    peaks: dict[torch.device, int] = {}
    x = torch.zeros(chunk, dtype=torch.int64)
    for stage, cache in zip(pipeline.stages, pipeline.caches):
        x = x.to(stage.device)
        outputs = []
        peak = peak_bytes(stage.device, lambda: outputs.append(stage(x, meta.to(stage.device), cache)))
        peaks[stage.device] = max(peaks.get(stage.device, 0), peak)
        x = outputs.pop()
    return peaks


def kv_blocks_that_fit(
    free: dict[torch.device, int], headroom: dict[torch.device, Headroom], per_block: dict[torch.device, int],
    fraction: float = GPU_MEMORY_FRACTION, reserved: dict[torch.device, int] | None = None,
) -> int:
    """The blocks every device can hold (each holds every block id for its stages' layers): of its
    free memory, `fraction`, less its headroom and the bytes `reserved` on it for other caches (a
    draft model's), in blocks of its size. Raises GraphrtError where the headroom alone takes that
    share, with the numbers and what to lower."""
    fits = []
    for device, size in per_block.items():
        budget = int(free[device] * fraction) - headroom[device].total - (reserved or {}).get(device, 0)
        if budget < 2 * size:
            room, draft = headroom[device], (reserved or {}).get(device, 0)
            drafts = f", a draft model's guesses {draft / 2**30:.2f}" if draft else ""
            raise GraphrtError(
                f"{device}: {free[device] / 2**30:.2f} GiB free after the weights, {fraction:.0%} of it is "
                f"{free[device] * fraction / 2**30:.2f} GiB, and serving needs {(room.total + draft) / 2**30:.2f} GiB of it besides "
                f"the KV cache (graph pools {room.graph_pools / 2**30:.2f}, ring buffers {room.ring_buffers / 2**30:.2f}, "
                f"activations {room.transient / 2**30:.2f}{drafts}): no room for a KV cache. Lower --max-batch, "
                "--prefill-chunk-size or --max-model-len"
                + (", max_num_seqs or num_speculative_tokens" if draft else "") + ", or spread the stages over more GPUs"
            )
        fits.append(budget // size)
    return min(fits)
