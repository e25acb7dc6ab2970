"""Multi-head latent attention (DeepSeek-V3, Kimi K2): the config as transformers reads it, yarn's
rotary tables and softmax scale, the latent cache's size, and configs refused naming the field.

The whole-model checks run in the suites every variant goes through (TINY_VARIANTS' deepseek-v3 and
deepseek-kimi-layout): logits against transformers at pp 1-3 and greedy tokens in float64
(test_tiny_parity.py), a head decompressing the latent wrongly changing every output
(test_informative_models.py), and the capture rehearsal with both kernel sets (test_rehearsal.py);
the ring and prefix caching in test_ring.py and test_prefix_caching.py.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
import transformers

from graphrt import LLM
from graphrt.errors import ModelLoadError
from graphrt.kernels.rotary import _inv_freq, rotary_cos_sin
from graphrt.model.config import ModelConfig, rope_from_hf
from graphrt.model.kv_cache import StageKVCache, bytes_per_block, describe_token_bytes


def hf_config_dict(config) -> dict:
    return json.loads(config.to_json_string(use_diff=False))


def deepseek_v3_full_size(**fields) -> transformers.DeepseekV3Config:
    """DeepSeek-V3's real shapes (transformers' defaults) and rope scaling, as its config.json has them."""
    rope = dict(
        rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4096, beta_fast=32,
        beta_slow=1, mscale=1.0, mscale_all_dim=1.0,
    )
    options = dict(architectures=["DeepseekV3ForCausalLM"], max_position_embeddings=163840, rope_parameters=rope)
    return transformers.DeepseekV3Config(**{**options, **fields})


def test_deepseek_v3s_config_reads_as_transformers_builds_its_attention():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    config = deepseek_v3_full_size()
    cfg = ModelConfig.from_hf(hf_config_dict(config))
    mla = cfg.mla
    assert (mla.q_lora_rank, mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim) == (
        1536, 512, 128, 64, 128
    )
    assert mla.rope_interleave and cfg.head_dim == 64  # the rotary tables are the rotary key's
    with torch.device("meta"):
        attention = DeepseekV3Attention(config, layer_idx=0)
    # qk_head_dim ** -0.5 times yarn's mscale(40, 1) squared: 1.37 times the plain scale
    assert mla.softmax_scale == pytest.approx(attention.scaling, rel=1e-15)
    assert mla.softmax_scale == pytest.approx(192**-0.5 * (0.1 * torch.log(torch.tensor(40.0)).item() + 1) ** 2, rel=1e-6)
    plain = ModelConfig.from_hf(hf_config_dict(deepseek_v3_full_size(rope_parameters=dict(rope_type="default", rope_theta=1e4))))
    assert plain.mla.softmax_scale == 192**-0.5


# Yarn as DeepSeek-V3 and Kimi K2 write it, with its attention factor from mscale / mscale_all_dim,
# given outright, inferred from factor alone, factor inferred from the contexts, and no truncation.
YARN = [
    dict(factor=40.0, original_max_position_embeddings=64, beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0),
    dict(factor=8.0, original_max_position_embeddings=32, mscale=0.707, mscale_all_dim=1.0),
    dict(factor=4.0, original_max_position_embeddings=64, attention_factor=1.3, truncate=False),
    dict(factor=4.0, original_max_position_embeddings=32, beta_fast=16, beta_slow=2),
    dict(factor=None, original_max_position_embeddings=64),  # factor: 256 / 64
]


@pytest.mark.parametrize("yarn", YARN, ids=range(len(YARN)))
def test_yarn_rotary_tables_equal_transformers(yarn):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.DeepseekV3Config(
        hidden_size=64, num_attention_heads=4, qk_rope_head_dim=16, max_position_embeddings=256,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, **yarn},
    )
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    rope = rope_from_hf(hf_config_dict(config))
    assert torch.equal(_inv_freq(rope, 16), inv_freq)
    cos, sin = rotary_cos_sin(rope, 16, 256)
    freqs = torch.outer(torch.arange(256, dtype=torch.float32), inv_freq)
    torch.testing.assert_close(cos[:, :8], freqs.cos() * attention_factor, atol=0, rtol=0)
    torch.testing.assert_close(sin[:, 8:], freqs.sin() * attention_factor, atol=0, rtol=0)
    assert attention_factor != 1.0 or yarn.get("mscale") == yarn.get("mscale_all_dim")  # the factor is exercised


def test_the_latent_cache_holds_576_values_a_token_a_layer_for_deepseek_v3():
    cfg = ModelConfig.from_hf(hf_config_dict(deepseek_v3_full_size()))
    assert bytes_per_block(cfg, num_layers=61, block_size=16, dtype=torch.bfloat16) == 61 * 16 * 576 * 2
    # against its 128 heads' keys (192) and values (128) uncompressed: 40,960 values
    assert 128 * (192 + 128) / 576 == pytest.approx(71.1, abs=0.05)
    assert describe_token_bytes(cfg, torch.bfloat16) == "68.6 KiB a token (MLA latent: 576 values a layer)"
    tiny = ModelConfig.from_hf(hf_config_dict(deepseek_v3_full_size(
        hidden_size=64, num_attention_heads=4, kv_lora_rank=32, qk_rope_head_dim=8, q_lora_rank=16, qk_nope_head_dim=8,
        v_head_dim=8, num_hidden_layers=2, intermediate_size=64, moe_intermediate_size=16, n_routed_experts=8,
        n_group=1, topk_group=1, num_experts_per_tok=2,
    )))
    cache = StageKVCache.allocate(tiny, 2, num_blocks=3, block_size=4, device=torch.device("cpu"), dtype=torch.float32)
    assert cache.k.shape == (2, 3, 4, 1, 40) and cache.v.shape == (2, 3, 4, 1, 32)
    cache.k[1, 2, 3, 0, :32] = 7.0  # v is the latent columns of k, not a copy
    assert cache.v[1, 2, 3, 0].eq(7.0).all() and cache.nbytes == 2 * 3 * 4 * 40 * 4


def test_the_banner_counts_the_latent_caches_bytes(tiny_model_factory):
    llm = LLM(model=tiny_model_factory("deepseek-v3"), dtype="float32", kv_cache_tokens=256)
    engine = llm.engine
    # 4 layers of a 32-value latent and an 8-value rotary key, float32
    assert describe_token_bytes(engine.model_config, engine.dtype) == "0.6 KiB a token (MLA latent: 40 values a layer)"
    assert sum(c.nbytes for c in engine.pipeline.caches) == engine.allocator.num_blocks * 16 * 4 * 40 * 4


REFUSED = [
    ({"attention_bias": True}, r"attention_bias true is not supported for DeepseekV3ForCausalLM"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}, r"quantization_config \(fp8\)"),
    ({"qk_rope_head_dim": 7}, r"qk_rope_head_dim 7"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, r"rope_type 'longrope'"),
]


@pytest.mark.parametrize(("fields", "named"), REFUSED, ids=[re.sub(r"\W", "", n)[:24] for _, n in REFUSED])
def test_a_deepseek_config_graphrt_does_not_implement_is_refused_naming_the_field(fields, named):
    raw = {**hf_config_dict(deepseek_v3_full_size()), **fields}
    with pytest.raises(ModelLoadError, match=named):
        ModelConfig.from_hf(raw)
