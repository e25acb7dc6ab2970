"""Stage layout, the KV block allocator, and when a sequence stops."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from graphrt import LLM, SamplingParams
from graphrt.config import EngineConfig
from graphrt.engine.block_allocator import BlockAllocator
from graphrt.engine.engine import Engine
from graphrt.errors import GraphrtError
from graphrt.model.config import ModelConfig
from graphrt.runtime.pipeline import partition_layers, stage_read_shares

SMOLLM2 = ModelConfig.from_hf(
    dict(
        architectures=["LlamaForCausalLM"], vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True,
    )
)


@pytest.mark.parametrize("pp", [1, 2, 3, 4, 8, 30])
def test_partition_is_contiguous_and_balances_weight_bytes(pp):
    ranges = partition_layers(SMOLLM2, pp)
    assert [r.start for r in ranges] == [0] + [r.stop for r in ranges[:-1]]
    assert ranges[-1].stop == 30 and all(len(r) >= 1 for r in ranges)
    if 1 < pp < 30:
        # The LM head (49152 x 576) weighs about 8 layers, so the last stage gets fewer layers.
        assert len(ranges[-1]) < len(ranges[0])


def test_partition_refuses_more_stages_than_layers():
    with pytest.raises(GraphrtError, match="--pp 31 is larger than the model's 30 layers; use --pp 30 or fewer"):
        partition_layers(SMOLLM2, 31)


def test_each_stage_holds_only_its_own_weights(tiny_model_factory):
    llm = LLM(model=tiny_model_factory("llama-mha-untied"), pp=3, kv_cache_tokens=64)
    stages = llm.engine.pipeline.stages
    assert [s.layer_ids for s in stages] == [range(0, 2), range(2, 3), range(3, 4)]
    assert stages[0].embed_tokens is not None and stages[0].lm_head is None
    assert stages[1].embed_tokens is None and stages[1].lm_head is None
    assert stages[2].embed_tokens is None and stages[2].lm_head is not None
    assert [len(s.layers) for s in stages] == [c.k.shape[0] for c in llm.engine.pipeline.caches]


def test_allocator_never_hands_out_the_scratch_block():
    allocator = BlockAllocator(num_blocks=5, block_size=16)
    blocks = allocator.allocate(4)
    assert sorted(blocks) == [1, 2, 3, 4] and allocator.num_free == 0
    with pytest.raises(RuntimeError):
        allocator.allocate(1)
    allocator.free(blocks)
    assert allocator.num_free == 4


def test_requests_wait_for_blocks_and_all_finish(tiny_model_factory):
    # Room for two requests at a time (3 blocks each); six requests queue and all complete.
    llm = LLM(model=tiny_model_factory(), dtype="float32", kv_cache_tokens=6 * 16, prefill_chunk_size=7)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    prompts = [[i + 1] * (5 + i) for i in range(6)]
    together = llm.generate(prompts, params)
    assert [len(o.token_ids) for o in together] == [30] * 6
    alone = [llm.generate(p, params)[0].token_ids for p in prompts]
    assert [o.token_ids for o in together] == alone
    assert llm.engine.allocator.num_free == llm.engine.allocator.num_blocks - 1


@pytest.fixture(scope="module")
def default_llm(default_model) -> LLM:
    """The default model as `LLM()` loads it, for the tests that only read what it generates."""
    llm = LLM(kv_cache_tokens=4096)
    assert llm.model_dir == default_model
    yield llm
    llm.engine.close()


def test_stop_string_and_eos(default_llm):
    llm = default_llm
    prompt = llm.chat_prompt("List the numbers 1 to 10.")
    full = llm.generate(prompt, SamplingParams(max_tokens=64, temperature=0))[0]
    assert full.finish_reason == "stop" and full.token_ids[-1] in llm.engine.eos_ids
    assert "5" in full.text
    stopped = llm.generate(prompt, SamplingParams(max_tokens=64, temperature=0, stop=["5"]))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == full.text[: full.text.index("5")]
    capped = llm.generate(prompt, SamplingParams(max_tokens=3, temperature=0))[0]
    assert capped.finish_reason == "length" and capped.token_ids == full.token_ids[:3]


def test_incremental_text_equals_decoding_the_whole_output(default_llm):
    llm = default_llm
    prompts = [llm.chat_prompt(q) for q in ("Say 'café' and add a smiley emoji.", "Write one sentence in French.")]
    sampled = SamplingParams(max_tokens=48, temperature=0.9, seed=3, ignore_eos=True)
    for output in llm.generate(prompts, sampled):
        assert output.text == llm.tokenizer.decode(output.token_ids)


def test_a_dense_models_partition_is_what_it_always_was_at_any_decode_rows():
    # Recorded before mixtures of experts weighed layers by decode rows: dense layers ignore them.
    before = {
        2: [(0, 19), (19, 30)],
        3: [(0, 13), (13, 26), (26, 30)],
        4: [(0, 10), (10, 20), (20, 29), (29, 30)],
        8: [(0, 5), (5, 10), (10, 15), (15, 20), (20, 25), (25, 28), (28, 29), (29, 30)],
    }
    for pp, bounds in before.items():
        for rows in (1, 32, 256):
            assert [(r.start, r.stop) for r in partition_layers(SMOLLM2, pp, rows)] == bounds


# Qwen3-MoE with 64 experts of 512 at top-4 over hidden 1024, its first 4 of 16 layers dense (MLP of
# 8192): at one row a sparse layer reads 4 experts, far less than a dense layer; at 64 rows nearly all.
MOE = ModelConfig.from_hf(
    dict(
        architectures=["Qwen3MoeForCausalLM"], vocab_size=32000, hidden_size=1024, intermediate_size=8192,
        num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_experts=64,
        num_experts_per_tok=4, moe_intermediate_size=512, mlp_only_layers=[0, 1, 2, 3],
    )
)


def expected_layer_elements(layer: int, rows: int) -> float:
    """The rule, written out: attention + (dense MLP | router + E * (1 - (1 - k/E)^B) experts)."""
    attention = 1024 * (16 * 64) * 2 + 1024 * (4 * 64) * 2
    if layer < 4:
        return attention + 3 * 1024 * 8192
    return attention + 64 * 1024 + 64 * (1 - (1 - 4 / 64) ** rows) * 3 * 1024 * 512


def heaviest_stage(ranges: list[range], rows: int) -> float:
    costs = [sum(expected_layer_elements(layer, rows) for layer in r) for r in ranges]
    costs[-1] += 32000 * 1024  # the LM head
    return max(costs)


def every_split(num_layers: int, pp: int):
    """All ways to cut layers [0, num_layers) into pp contiguous non-empty ranges."""
    from itertools import combinations

    for cuts in combinations(range(1, num_layers), pp - 1):
        bounds = [0, *cuts, num_layers]
        yield [range(a, b) for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("pp", [2, 3, 4])
@pytest.mark.parametrize("rows", [1, 8, 64])
def test_a_moe_partition_balances_the_expected_bytes_at_its_decode_rows(pp, rows):
    ranges = partition_layers(MOE, pp, rows)
    best = min(heaviest_stage(split, rows) for split in every_split(16, pp))
    assert heaviest_stage(ranges, rows) == pytest.approx(best, rel=1e-9)


def test_a_moe_partition_depends_on_how_many_experts_a_step_reads():
    one_row, many_rows = partition_layers(MOE, 2, 1), partition_layers(MOE, 2, 64)
    # At one row the dense-first layers are the heavy ones, so stage 0 holds few layers; at 64 rows
    # the sparse layers read nearly all their experts and outweigh them.
    assert len(one_row[0]) < len(many_rows[0])
    # Balanced for one row, the pipeline would be lopsided at 64.
    assert heaviest_stage(one_row, 64) > 1.1 * heaviest_stage(many_rows, 64)


@pytest.mark.parametrize("pp", [2, 3])
def test_the_banner_gives_each_stages_share_of_a_steps_bytes(tiny_model_factory, pp):
    llm = LLM(model=tiny_model_factory("qwen3-moe-dense-first"), pp=pp, dtype="float32", kv_cache_tokens=256, max_batch=8)
    engine = llm.engine
    shares = stage_read_shares(engine.model_config, engine.layers, 8)
    assert sum(shares) == pytest.approx(1.0, abs=1e-12)
    # Against the loaded weights' bytes, read as a step of 8 rows reads them (norms aside).
    loaded = [stage.weight_reads().at(8) for stage in engine.pipeline.stages]
    assert shares == pytest.approx([b / sum(loaded) for b in loaded], abs=0.01)
    summary = engine.stage_summary()
    assert summary.startswith("a 8-row decode step's weight bytes (expected experts) by stage: ")
    printed = [int(p) for p in re.findall(r"(\d+)%", summary)]
    assert printed == [round(100 * s) for s in shares] and abs(sum(printed) - 100) <= pp // 2
    assert summary.count("LM head") == 1 and summary.rstrip().endswith(f"+ LM head {printed[-1]}%")


@pytest.mark.parametrize(
    "device, options, rows",
    [
        ("cpu", {}, 32),  # a CPU's default largest bucket
        ("cuda", {}, 64),  # on a GPU the cache sets the largest bucket later: the most a step carries stands in
        ("cuda", {"max_num_seqs": 512}, 256),  # ... up to GPU_MAX_BATCH_LIMIT
        ("cuda", {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}, 256),  # 64 rows x (1 + 3)
        ("cuda", {"max_batch": 16}, 16),
        ("cpu", {"buckets": [1, 4, 12]}, 12),
    ],
)
def test_the_partition_weighs_a_step_at_the_largest_bucket_it_can_have(device, options, rows):
    """Both branches of the device type, by parameter: the rows `partition_layers` weighs a mixture
    of experts at, decided before any device memory is read."""
    config = EngineConfig(**options)
    engine = SimpleNamespace(config=config, devices=[torch.device(device)])
    engine._max_decode_tokens = lambda: Engine._max_decode_tokens(engine)
    assert config.max_num_seqs == options.get("max_num_seqs", 64)
    assert Engine._partition_rows(engine) == rows
