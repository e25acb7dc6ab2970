"""The tiny random models can tell positions, heads and contexts apart.

Tests elsewhere compare greedy tokens (with transformers, across pipeline splits, preemption and
batching). That only proves something if a wrong position or a wrong K/V head changes those
tokens: here each such bug is planted on a healthy engine and must change every prompt's greedy
output, and the output itself must not be one token repeated.
"""

from __future__ import annotations

import dataclasses

import pytest
from conftest import TINY_VARIANTS

from graphrt import LLM, SamplingParams

PROMPTS = [[5, 9, 13], list(range(20, 31)), [1, 2, 3]]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def greedy_outputs(llm: LLM) -> list[list[int]]:
    return [output.token_ids for output in llm.generate(PROMPTS, GREEDY)]


def without_rotary(llm: LLM) -> None:
    """Every position rotates by 0, as if RoPE were never applied."""
    for stage in llm.engine.pipeline.stages:
        stage.cos.fill_(1.0)
        stage.sin.zero_()


def decode_positions_off_by_one(llm: LLM) -> None:
    """Decode micro-batches rotate q and k as if one position later; prompts are unchanged."""
    for stage in llm.engine.pipeline.stages:

        def shifted(x, meta, cache, forward=stage.forward):
            if not meta.is_prefill:
                meta = dataclasses.replace(meta, positions=meta.positions + 1)
            return forward(x, meta, cache)

        stage.forward = shifted


def kv_heads_swapped(llm: LLM) -> None:
    """K/V heads 0 and 1 trade places in the cache, so query heads read another group's keys and values."""
    for stage in llm.engine.pipeline.stages:
        for layer in stage.layers:

            def write_swapped(k, v, k_cache, v_cache, slots, write=layer.ops.write_kv):
                order = [1, 0, *range(2, k.shape[1])]  # k, v: (tokens, kv_heads, head_dim)
                return write(k[:, order], v[:, order], k_cache, v_cache, slots)

            layer.ops = dataclasses.replace(layer.ops, write_kv=write_swapped)


def latent_heads_swapped(llm: LLM) -> None:
    """Latent attention's heads 0 and 1 trade their W_UK and W_UV (kv_b_proj), so each head reads the
    latent through the other's keys and values (graphrt/model/mla.py)."""
    for stage in llm.engine.pipeline.stages:
        for layer in stage.layers:
            per_head = layer.mla.kv_b_proj.data.view(stage.cfg.num_heads, -1, stage.cfg.mla.kv_lora_rank)
            per_head[[0, 1]] = per_head[[1, 0]].clone()


def tiny_llm(tiny_model_factory, variant: str) -> LLM:
    return LLM(model=tiny_model_factory(variant), dtype="float32", kv_cache_tokens=256)


@pytest.mark.parametrize("variant", sorted(TINY_VARIANTS))
def test_greedy_output_is_not_one_token_repeated(tiny_model_factory, variant):
    # Measured: 5 to 12 distinct tokens in each 12 (the models from before had 1 to 3).
    for tokens in greedy_outputs(tiny_llm(tiny_model_factory, variant)):
        assert len(set(tokens)) >= 5, tokens


@pytest.mark.parametrize("variant", sorted(TINY_VARIANTS))
@pytest.mark.parametrize("perturb", [without_rotary, decode_positions_off_by_one], ids=lambda f: f.__name__)
def test_a_position_bug_changes_every_greedy_output(tiny_model_factory, variant, perturb):
    healthy = greedy_outputs(tiny_llm(tiny_model_factory, variant))
    broken_llm = tiny_llm(tiny_model_factory, variant)
    perturb(broken_llm)
    for prompt, good, bad in zip(PROMPTS, healthy, greedy_outputs(broken_llm)):
        assert bad != good, f"prompt {prompt}: {perturb.__name__} left the greedy tokens {good} unchanged"


# llama3-rope has a single K/V head (multi-query attention): there is no other head to read.
LATENT = sorted(v for v, (_, extra) in TINY_VARIANTS.items() if "kv_lora_rank" in extra)
SEVERAL_KV_HEADS = sorted(v for v, (_, extra) in TINY_VARIANTS.items() if extra["num_key_value_heads"] > 1 and v not in LATENT)


@pytest.mark.parametrize("variant", SEVERAL_KV_HEADS + LATENT)
def test_reading_the_wrong_kv_head_changes_every_greedy_output(tiny_model_factory, variant):
    """A latent attention model caches no heads: there each head decompresses the latent wrongly."""
    healthy = greedy_outputs(tiny_llm(tiny_model_factory, variant))
    broken_llm = tiny_llm(tiny_model_factory, variant)
    (latent_heads_swapped if variant in LATENT else kv_heads_swapped)(broken_llm)
    for prompt, good, bad in zip(PROMPTS, healthy, greedy_outputs(broken_llm)):
        assert bad != good, f"prompt {prompt}: swapping K/V heads left the greedy tokens {good} unchanged"
