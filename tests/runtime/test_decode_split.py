"""How deep the ring is and how many micro-batches a decode round's rows are spread over: both count
the stages that compute at the same time (one per GPU, every CPU stage), not the stages.

Stages that share a GPU take turns on its memory bandwidth; rows split between them only read the
same weights again (pp 4 on one GPU at batch 64: 5 micro-batches of 12 rows, 0.35-0.5x of pp 1).
"""

from __future__ import annotations

import pytest
import torch

import graphrt.config
from graphrt import LLM, SamplingParams
from graphrt.config import EngineConfig, default_devices, num_concurrent_stages


@pytest.mark.parametrize(
    "devices, concurrent, depth, micro_batches",
    [
        (["cuda:0"] * 4, 1, 0, 1),  # pp 4 on one GPU: one micro-batch of rows, as pp 1
        (["cuda:0"] * 2, 1, 0, 1),
        (["cuda"] * 2, 1, 0, 1),  # "cuda" is cuda:0
        (["cuda", "cuda:0"], 1, 0, 1),
        (["cuda:0", "cuda:1"], 2, 1, 3),  # two GPUs: the depth and the split they had
        (["cuda:0", "cuda:0", "cuda:1", "cuda:1"], 2, 1, 3),  # pp 4 on two GPUs
        ([f"cuda:{i}" for i in range(4)], 4, 1, 5),
        (["cpu"] * 2, 2, 0, 2),  # CPU stages each run on a thread of their own: unchanged
        (["cpu"], 1, 0, 1),
        (["cuda:0"], 1, 0, 1),
    ],
)
def test_depth_and_row_split_count_devices_not_stages(devices, concurrent, depth, micro_batches):
    config = EngineConfig(pp=len(devices), devices=devices)
    assert num_concurrent_stages(devices) == concurrent
    assert config.depth == depth
    assert config.num_decode_micro_batches(devices) == micro_batches


def test_a_depth_given_adds_to_the_split():
    config = EngineConfig(pp=4, devices=["cuda:0"] * 4, depth=2)
    assert config.num_decode_micro_batches(config.devices) == 3


@pytest.mark.parametrize("num_gpus, depth", [(1, 0), (2, 1), (4, 1)])
def test_devices_chosen_from_the_machine_get_the_depth_of_what_they_share(monkeypatch, num_gpus, depth):
    """Without --devices, pp 2 shares one GPU where there is one, and takes two where there are."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: num_gpus)
    assert default_devices(2) == (["cuda:0", "cuda:1"] if num_gpus >= 2 else ["cuda:0", "cuda:0"])
    assert EngineConfig(pp=2).depth == depth


def decode_batch_sizes(llm: LLM, prompts: list[list[int]]) -> list[int]:
    """The rows of every decode micro-batch the scheduler hands out while `prompts` are generated."""
    scheduler = llm.engine.scheduler
    schedule, sizes = scheduler.schedule, []

    def recording(*args, **kwargs):
        step = schedule(*args, **kwargs)
        if step is not None and not step.is_prefill:
            sizes.append(len(step.seqs))
        return step

    scheduler.schedule = recording
    llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    return sizes


def test_stages_that_share_a_device_decode_all_rows_in_one_micro_batch(tiny_model_factory, monkeypatch):
    """The engine hands the scheduler the split, not the ring's slot count. Two CPU stages stand in
    for two stages on one GPU by counting as one concurrent stage (what a shared GPU counts as)."""
    options = dict(model=tiny_model_factory(), pp=2, devices=["cpu", "cpu"], depth=0, buckets=[1, 2, 4, 8], kv_cache_tokens=1024)
    prompts = [[3 + i] * (2 + i) for i in range(6)]

    as_cpu = LLM(**options)
    assert as_cpu.engine.ring.num_slots == 2 and as_cpu.engine.num_decode_micro_batches == 2
    assert max(decode_batch_sizes(as_cpu, prompts)) == 3  # two CPU threads: half the rows each
    as_cpu.engine.close()

    monkeypatch.setattr(graphrt.config, "num_concurrent_stages", lambda devices: 1)
    shared = LLM(**options)
    assert shared.engine.ring.num_slots == 2 and shared.engine.num_decode_micro_batches == 1
    sizes = decode_batch_sizes(shared, prompts)
    assert set(sizes) == {6}, sizes  # every round in one micro-batch: each weight read once per round
    shared.engine.close()
