"""Stage layout, the KV block allocator, and when a sequence stops."""

from __future__ import annotations

import pytest

from graphrt import LLM, SamplingParams
from graphrt.engine.block_allocator import BlockAllocator
from graphrt.errors import GraphrtError
from graphrt.model.config import ModelConfig
from graphrt.runtime.pipeline import partition_layers

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


def test_stop_string_and_eos(default_model):
    llm = LLM(kv_cache_tokens=4096)
    prompt = llm.chat_prompt("List the numbers 1 to 10.")
    full = llm.generate(prompt, SamplingParams(max_tokens=64, temperature=0))[0]
    assert full.finish_reason == "stop" and full.token_ids[-1] in llm.engine.eos_ids
    assert "5" in full.text
    stopped = llm.generate(prompt, SamplingParams(max_tokens=64, temperature=0, stop=["5"]))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == full.text[: full.text.index("5")]
    capped = llm.generate(prompt, SamplingParams(max_tokens=3, temperature=0))[0]
    assert capped.finish_reason == "length" and capped.token_ids == full.token_ids[:3]


def test_incremental_text_equals_decoding_the_whole_output(default_model):
    llm = LLM(kv_cache_tokens=4096)
    prompts = [llm.chat_prompt(q) for q in ("Say 'café' and add a smiley emoji.", "Write one sentence in French.")]
    sampled = SamplingParams(max_tokens=48, temperature=0.9, seed=3, ignore_eos=True)
    for output in llm.generate(prompts, sampled):
        assert output.text == llm.tokenizer.decode(output.token_ids)
