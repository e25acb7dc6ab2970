"""The KV cache on GPUs takes its share of free memory after what graph pools, ring buffers and
activations will need is measured, not before they exist.

torch.cuda's memory calls are replaced: a real (CPU) pipeline runs the probe, and the fakes say how
much each run allocated at its peak and how much memory is free, and notice when they are asked.
"""

from __future__ import annotations

import pytest
import torch

from graphrt import LLM
from graphrt.engine.kv_budget import GPU_MEMORY_FRACTION, Headroom, kv_blocks_that_fit
from graphrt.errors import GraphrtError
from graphrt.model.kv_cache import bytes_per_block
from graphrt.speculative import SpeculativeConfig

GiB, MiB = 1 << 30, 1 << 20
GPU0, GPU1 = torch.device("cuda", 0), torch.device("cuda", 1)


def test_each_device_keeps_its_headroom_and_the_tightest_decides():
    free = {GPU0: 40 * GiB, GPU1: 20 * GiB}
    headroom = {GPU0: Headroom(graph_pools=2 * GiB, ring_buffers=GiB // 4, transient=GiB), GPU1: Headroom(transient=6 * GiB)}
    per_block = {GPU0: 2 << 20, GPU1: 1 << 20}
    on_gpu0 = (int(40 * GiB * GPU_MEMORY_FRACTION) - (3 * GiB + GiB // 4)) // (2 << 20)
    on_gpu1 = (int(20 * GiB * GPU_MEMORY_FRACTION) - 6 * GiB) // (1 << 20)
    assert kv_blocks_that_fit(free, headroom, per_block) == min(on_gpu0, on_gpu1) == on_gpu1


def test_no_room_for_a_cache_says_what_took_it():
    with pytest.raises(GraphrtError, match=r"graph pools 3\.00.*Lower --max-batch"):
        kv_blocks_that_fit({GPU0: 4 * GiB}, {GPU0: Headroom(graph_pools=3 * GiB, transient=GiB)}, {GPU0: 1 << 20})


def test_no_room_because_of_a_draft_models_guesses_says_so():
    with pytest.raises(GraphrtError, match=r"a draft model's guesses 3\.00.*num_speculative_tokens"):
        kv_blocks_that_fit(
            {GPU0: 4 * GiB}, {GPU0: Headroom(transient=GiB)}, {GPU0: 1 << 20}, reserved={GPU0: 3 * GiB},
        )


class FakeCudaMemory:
    """Every probe run peaks at `peak` bytes; `free` bytes are free once the probe's cache is gone."""

    def __init__(self, pipeline, free: int, peak: int):
        self.pipeline, self.free, self.peak = pipeline, free, peak
        self.free_read_with_probe_alive: list[bool] = []
        self.runs = 0

    def mem_get_info(self, device=None):
        alive = bool(self.pipeline.caches)
        self.free_read_with_probe_alive.append(alive)
        probe = sum(c.k.nbytes + c.v.nbytes for c in self.pipeline.caches)
        return self.free - probe, 80 * GiB

    def max_memory_allocated(self, device=None):
        self.runs += 1
        return self.peak


@pytest.fixture(scope="module")
def cpu_engine(tiny_model_factory):
    llm = LLM(model=tiny_model_factory(), pp=2, devices=["cpu", "cpu"], dtype="float32", kv_cache_tokens=1024, buckets=[1, 2, 4, 8])
    yield llm.engine
    llm.engine.close()


class DraftModelBytes:
    """What the KV budget asks of a draft model: the bytes of a block of its cache."""

    def __init__(self, bytes_per_block: int):
        self.bytes_per_block = bytes_per_block

    def kv_bytes_per_block(self, block_size: int) -> int:
        return self.bytes_per_block


@pytest.mark.parametrize("draft_bytes", [None, 512], ids=["alone", "with-a-draft-model"])
def test_the_cache_is_sized_after_measuring_what_serving_needs_besides_it(cpu_engine, monkeypatch, draft_bytes):
    """The engine's sizing on a (pretend) GPU: a probe runs the stages, is freed, and only then is
    free memory read; the graph pools of both stages, the ring's buffers and the largest transient
    peak are left free. A draft model's cache has a block for each of the target's (their bytes add
    up) and its rows' guesses, whose blocks are left free too."""
    engine = cpu_engine
    draft_model = DraftModelBytes(draft_bytes) if draft_bytes else None
    if draft_model is not None:
        spec = SpeculativeConfig(method="draft_model", model="draft", num_speculative_tokens=3)
        monkeypatch.setattr(engine.config, "speculative_config", spec)
    memory = FakeCudaMemory(engine.pipeline, free=24 * MiB, peak=2 * MiB)  # sizes to suit a tiny model's blocks
    for name, fake in {
        "mem_get_info": memory.mem_get_info, "max_memory_allocated": memory.max_memory_allocated,
        "memory_allocated": lambda device=None: 0, "reset_peak_memory_stats": lambda device=None: None,
        "synchronize": lambda device=None: None, "empty_cache": lambda: None,
    }.items():
        monkeypatch.setattr(torch.cuda, name, fake)
    caches = engine.pipeline.caches
    monkeypatch.setattr(engine.config, "kv_cache_tokens", None)
    monkeypatch.setattr(engine, "devices", [GPU0, GPU0])  # sized as on one GPU; the stages still run on the CPU
    monkeypatch.setattr(engine, "backend", "cuda")
    try:
        num_blocks = engine._num_kv_blocks(draft_model)
    finally:
        engine.pipeline.caches = caches

    assert memory.free_read_with_probe_alive == [False], "free memory was read while the probe's cache was held"
    assert memory.runs == 2 + 2 + 1  # a decode step per stage, a prefill chunk through both, sampling
    config, cfg = engine.config, engine.model_config
    max_batch = 8  # the largest of the buckets given
    max_tokens = max(config.prefill_chunk_size, max_batch)
    ring = (config.pp + config.depth) * max_tokens * cfg.hidden_size * 4 + (config.pp + config.depth) * 2 * max_tokens * 8
    headroom = 2 * 2 * MiB + 2 * MiB + ring  # both stages' graph pools, one transient peak, the ring
    per_block = sum(bytes_per_block(cfg, len(s.layers), config.block_size, torch.float32) for s in engine.pipeline.stages)
    guesses = 0
    if draft_model is not None:
        per_block += draft_bytes
        guesses = config.max_num_seqs * -(-3 // config.block_size) * draft_bytes  # a block per row for 3 guesses
    expected = (int(24 * MiB * GPU_MEMORY_FRACTION) - headroom - guesses) // per_block
    enough = config.max_num_seqs * -(-engine.max_model_len // config.block_size) + 1
    assert expected < enough, "the test's numbers must leave memory, not max_num_seqs, deciding"
    assert num_blocks == expected
