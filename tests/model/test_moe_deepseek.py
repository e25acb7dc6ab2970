"""DeepSeek-V3's (and Kimi K2's) mixture of experts against transformers' own modules: the grouped
sigmoid routing (`route_grouped_topk`) against its router, the whole sparse block (`SparseMoE`,
with DeepSeek's ungated shared experts) against `DeepseekV3MoE`, the layers it makes sparse, and a
stage holding the block through the capture rehearsal. The whole model (with its latent
attention) is checked in the suites every tiny variant goes through (tests/model/test_mla.py).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import transformers

from graphrt.capture.graphs import StaticInputs
from graphrt.capture.rehearsal import RehearsalError, rehearse_stage
from graphrt.errors import ModelLoadError
from graphrt.kernels.cpu.moe import fused_moe_by_expert
from graphrt.kernels.moe import fused_moe, route_grouped_topk
from graphrt.kernels.rotary import RopeConfig
from graphrt.kernels.torch_ops import TORCH
from graphrt.model.config import ModelConfig, moe_from_hf
from graphrt.model.moe import SparseMoE
from graphrt.model.weights import WeightFiles
from graphrt.runtime.pipeline import Pipeline


def deepseek_config(**fields) -> transformers.DeepseekV3Config:
    """A tiny DeepseekV3Config: hidden 64, 16 routed experts in 4 groups, top-4 of the best 2 groups."""
    options = dict(
        vocab_size=64, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=2, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
        topk_group=2, n_shared_experts=1, first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5,
        q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
        architectures=["DeepseekV3ForCausalLM"],
    )  # fmt: skip
    return transformers.DeepseekV3Config(**{**options, **fields})


def hf_config_dict(config) -> dict:
    """What transformers writes to config.json for `config`."""
    return json.loads(config.to_json_string(use_diff=False))


def hf_router(config, seed: int, bias_scale: float):
    # Imported here: transformers' modeling modules import triton, which must not happen while pytest
    # collects, before test_rehearsal.py sets TRITON_INTERPRET=1 for the Triton kernels.
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    router = DeepseekV3TopkRouter(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen))
        router.e_score_correction_bias.copy_(torch.randn(router.num_experts, generator=gen) * bias_scale)
    return router


def by_expert(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's choices in the order of their expert ids: transformers' top-k is unsorted."""
    order = ids.argsort(dim=-1)
    return weights.gather(1, order), ids.gather(1, order)


# (experts, n_group, topk_group, top_k, norm_topk_prob, routed_scaling_factor): one group (Kimi K2's
# layout), the best 1 or 2 of 4 groups, top-k up to the eligible experts, with and without renormalizing.
ROUTINGS = [
    (16, 1, 1, 4, True, 2.5),
    (16, 4, 2, 4, True, 2.5),
    (16, 4, 2, 8, False, 1.0),
    (16, 4, 1, 3, True, 1.0),
    (32, 4, 2, 6, False, 2.5),
    (12, 4, 1, 1, True, 2.5),
]


@pytest.mark.parametrize(("num_experts", "n_group", "topk_group", "top_k", "normalize", "scaling"), ROUTINGS)
def test_grouped_routing_matches_transformers_router(num_experts, n_group, topk_group, top_k, normalize, scaling):
    config = deepseek_config(
        n_routed_experts=num_experts, n_group=n_group, topk_group=topk_group, num_experts_per_tok=top_k,
        norm_topk_prob=normalize, routed_scaling_factor=scaling,
    )  # fmt: skip
    router = hf_router(config, seed=num_experts + 10 * n_group + top_k, bias_scale=0.5)
    hidden = torch.randn(60, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, hf_weights, hf_ids = router(hidden)
    weights, ids = route_grouped_topk(
        logits, top_k, router.e_score_correction_bias, n_group, topk_group, normalize, scaling
    )  # fmt: skip
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == (60, top_k)
    weights, ids = by_expert(weights, ids)
    hf_weights, hf_ids = by_expert(hf_weights, hf_ids)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights, atol=1e-6, rtol=0)
    expected_sum = torch.full((60,), scaling) if normalize else (torch.sigmoid(logits).gather(1, ids) * scaling).sum(-1)
    torch.testing.assert_close(weights.sum(-1), expected_sum)
    # Only experts of the topk_group best groups are chosen: never more groups than that in a row.
    groups_used = torch.zeros(60, n_group).scatter_(1, ids // (num_experts // n_group), 1.0).sum(-1)
    assert groups_used.max() <= topk_group


def test_the_bias_changes_the_choice_but_not_the_weights():
    """e_score_correction_bias steers which experts are chosen; the weights stay the unbiased scores.
    With the bias the choice is not the plain top-k of the scores, and it matches transformers."""
    config = deepseek_config(n_group=4, topk_group=2, num_experts_per_tok=4, norm_topk_prob=False, routed_scaling_factor=1.0)
    router = hf_router(config, seed=3, bias_scale=0.5)
    hidden = torch.randn(40, 64, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        logits, _, hf_ids = router(hidden)
    bias = router.e_score_correction_bias
    weights, ids = route_grouped_topk(logits, 4, bias, 4, 2, False, 1.0)
    _, unbiased_ids = route_grouped_topk(logits, 4, torch.zeros_like(bias), 4, 2, False, 1.0)
    assert (ids.sort(-1).values != unbiased_ids.sort(-1).values).any(dim=-1).sum() >= 10  # the bias moved many rows
    assert torch.equal(ids.sort(-1).values, hf_ids.sort(-1).values)
    assert torch.equal(weights, torch.sigmoid(logits).gather(1, ids))  # unbiased scores, not scores + bias


def float32_midpoints(count: int) -> torch.Tensor:
    """float64 logits halfway between neighbouring float32 numbers: one float64 step either side of
    them rounds to float32 a whole float32 step apart."""
    low = torch.linspace(-3, 3, count, dtype=torch.float32)
    return (low.double() + torch.nextafter(low, torch.tensor(float("inf"))).double()) / 2


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_a_float64_router_keeps_float64_so_a_last_bit_moves_its_weights_by_a_last_bit(scoring):
    """A padded and an unpadded batch give a row's float64 logits that differ in their last bits;
    routed in float32, a tiny DeepSeek-V3 model's weights moved by 6e-8, and capture's float64 check
    (1e-10) refused its stage at bucket 32 (a new-user trial, plain rope)."""
    from graphrt.kernels.moe import route_topk

    logits = float32_midpoints(16).reshape(1, 16)
    ulp = torch.finfo(torch.float64).eps * logits.abs()
    below, above = logits - 2 * ulp, logits + 2 * ulp
    if scoring == "softmax":
        (w_below, ids_below), (w_above, ids_above) = route_topk(below, 4, True), route_topk(above, 4, True)
    else:
        bias = torch.zeros(16, dtype=torch.float64)
        (w_below, ids_below), (w_above, ids_above) = (route_grouped_topk(x, 4, bias, 4, 2, True, 2.5) for x in (below, above))
    assert torch.equal(ids_below, ids_above)
    assert (w_below - w_above).abs().max() < 1e-12  # float32 weights: a float32 step apart, about 6e-8
    assert w_below.dtype == torch.float64
    assert route_topk(logits.float(), 4, True)[0].dtype == torch.float32  # narrower models keep float32


def deepseek_block(config, dtype: torch.dtype, seed: int):
    """transformers' DeepseekV3MoE with random weights in `dtype`; its router stays in float32, as
    from_pretrained keeps it (`_keep_in_fp32_modules_strict`)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    config._experts_implementation = "eager"  # its default (grouped_mm) computes no float64
    block = DeepseekV3MoE(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in block.state_dict().items():
            scale = 0.5 if name.endswith("e_score_correction_bias") else 0.2
            tensor.copy_(torch.randn(tensor.shape, generator=gen) * scale)
    block = block.to(dtype).eval()
    block.gate.float()
    return block


def block_model_config(config) -> ModelConfig:
    """The ModelConfig a DeepSeek-V3 model's sparse block reads (its size and MoeConfig, from what
    transformers writes); ModelConfig.from_hf refuses the whole model while MLA is not built."""
    raw = hf_config_dict(config)
    return ModelConfig(
        architecture="DeepseekV3ForCausalLM", vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"], num_layers=raw["num_hidden_layers"],
        num_heads=raw["num_attention_heads"], num_kv_heads=raw["num_key_value_heads"], head_dim=raw["head_dim"],
        rms_norm_eps=raw["rms_norm_eps"], max_position=raw["max_position_embeddings"], rope=RopeConfig(theta=10000.0),
        tie_word_embeddings=False, moe=moe_from_hf("deepseek_v3", raw),
    )  # fmt: skip


def load_block(block, cfg: ModelConfig, layer: int, dtype: torch.dtype) -> SparseMoE:
    """Our SparseMoE with `block`'s weights, found as Stage.load finds them: under the checkpoint
    names SparseMoE gives (experts as transformers holds them in memory, stacked), in the model's dtype."""
    prefix = f"model.layers.{layer}.mlp."
    checkpoint = {prefix + name: tensor for name, tensor in block.state_dict().items()}
    names = SparseMoE.hf_names(cfg, layer)
    names.update({ours: [stacked] for ours, stacked in SparseMoE.stacked_hf_names(layer).items()})
    assert {n for group in names.values() for n in group} == checkpoint.keys(), "every tensor read, none missing"
    moe = SparseMoE(cfg)
    state = {ours: torch.cat([checkpoint[n] for n in theirs]).to(dtype) for ours, theirs in names.items()}
    moe.load_state_dict(state, strict=True, assign=True)
    return moe


@pytest.mark.parametrize("num_tokens", [1, 3, 17])
@pytest.mark.parametrize("experts", [fused_moe, fused_moe_by_expert], ids=["reference", "cpu-by-expert"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize(("num_experts", "top_k"), [(16, 4), (8, 2)])
def test_sparse_moe_equals_transformers_deepseek_block(num_experts, top_k, dtype, experts, num_tokens):
    config = deepseek_config(n_routed_experts=num_experts, num_experts_per_tok=top_k)
    cfg = block_model_config(config)
    block = deepseek_block(config, dtype, seed=num_experts + top_k)
    moe = load_block(block, cfg, layer=1, dtype=dtype)
    assert moe.shared_expert_gate is None and moe.shared_down_proj.shape == (64, 32)  # one ungated shared expert
    hidden = torch.randn(num_tokens, 64, generator=torch.Generator().manual_seed(num_tokens)).to(dtype)
    ops = dataclasses.replace(TORCH, fused_moe=experts)
    with torch.no_grad():
        out = moe(hidden, ops)
        if dtype == torch.float32:
            expected = block(hidden.unsqueeze(0)).squeeze(0)
        else:
            # A float64 model routes in float64 (a float32 GEMM rounds by batch shape, and a float32
            # sigmoid turns last-bit differences into float32 steps), transformers in float32: the
            # same experts, weights within float32 rounding, and the rest of the block exact given
            # the same routing.
            weights, ids = moe.route(hidden, ops)
            _, hf_weights, hf_ids = block.gate(hidden)
            assert torch.equal(by_expert(weights, ids)[1], by_expert(hf_weights, hf_ids)[1]) and weights.dtype == torch.float64
            torch.testing.assert_close(by_expert(weights, ids)[0], by_expert(hf_weights, hf_ids)[0].double(), atol=1e-6, rtol=0)
            expected = block.experts(hidden, ids, weights) + block.shared_experts(hidden)
    assert out.dtype == dtype
    torch.testing.assert_close(out, expected, atol=1e-5 if dtype == torch.float32 else 1e-12, rtol=0)


@pytest.mark.parametrize("first_k_dense_replace", [0, 1, 3])
def test_sparse_layers_are_the_ones_transformers_builds(first_k_dense_replace):
    config = deepseek_config(first_k_dense_replace=first_k_dense_replace, num_hidden_layers=4)
    hf_layers = transformers.AutoModelForCausalLM.from_config(config).model.layers
    hf_sparse = [type(layer.mlp).__name__ == "DeepseekV3MoE" for layer in hf_layers]
    moe = moe_from_hf("deepseek_v3", hf_config_dict(config))
    assert [moe.is_sparse(layer) for layer in range(4)] == hf_sparse
    assert (moe.num_experts, moe.n_group, moe.topk_group, moe.routed_scaling_factor) == (16, 4, 2, 2.5)
    assert (moe.scoring, moe.shared_expert_size, moe.shared_expert_gated) == ("sigmoid", 32, False)


# (fields to set in config.json, the field the error must name)
REFUSED = [
    ({"n_group": 3}, "n_group"),  # 16 experts do not split into 3 groups
    ({"n_group": 16, "topk_group": 2}, "n_group"),  # groups of 1: a group's score is its best two
    ({"topk_group": 5}, "topk_group"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),  # more than the 8 experts of 2 groups of 4
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"topk_method": "greedy"}, "topk_method"),
    ({"moe_layer_freq": 2}, "moe_layer_freq"),
]


@pytest.mark.parametrize(("fields", "named"), REFUSED, ids=[n + "-" + str(list(f.values())[0]) for f, n in REFUSED])
def test_a_deepseek_moe_graphrt_does_not_implement_is_refused_naming_the_field(fields, named):
    with pytest.raises(ModelLoadError, match=named):
        moe_from_hf("deepseek_v3", {**hf_config_dict(deepseek_config()), **fields})


def boolean_mask_routing(router_logits, top_k, bias, n_group, topk_group, norm_topk_prob, scaling):
    """Grouped routing as one might write it eagerly: the eligible experts picked by a boolean mask,
    whose size depends on the routing."""
    scores = torch.sigmoid(router_logits.float())
    scores[scores > 0] = scores[scores > 0] * 1.0  # how many are True sets a size
    return route_grouped_topk(router_logits, top_k, bias, n_group, topk_group, norm_topk_prob, scaling)


def test_rehearsal_accepts_the_grouped_routing_in_a_stage(tiny_model_factory, monkeypatch):
    """The DeepSeek block, put in place of a Qwen3-MoE stage's sparse layer (attention stays
    Llama's: MLA is not built), passes the capture rehearsal; a routing that indexes by a boolean
    mask in its place is named."""
    model_dir = tiny_model_factory("qwen3-moe-dense-first")
    cfg = ModelConfig.from_dir(model_dir)
    pipeline = Pipeline.load(cfg, WeightFiles(model_dir), [torch.device("cpu")] * 2, torch.float32, cfg.max_position, "torch")
    pipeline.allocate_kv(8, 16)
    stage, cache = pipeline.stages[1], pipeline.caches[1]
    sparse = [layer for layer in stage.layers if layer.moe is not None]
    assert sparse, "stage 1 of qwen3-moe-dense-first holds a sparse layer"
    config = deepseek_config(hidden_size=cfg.hidden_size, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2)
    deepseek_cfg = dataclasses.replace(cfg, moe=moe_from_hf("deepseek_v3", hf_config_dict(config)))
    block = deepseek_block(config, torch.float32, seed=0)
    sparse[0].moe = load_block(block, deepseek_cfg, layer=0, dtype=torch.float32)
    inputs = lambda: StaticInputs.allocate(stage, 4, max_blocks=cfg.max_position // 16)  # noqa: E731
    rehearse_stage(stage, cache, inputs())
    monkeypatch.setattr("graphrt.model.moe.route_grouped_topk", boolean_mask_routing)
    with pytest.raises(RehearsalError, match=r"^stage 1, bucket 4: aten\.index"):
        rehearse_stage(stage, cache, inputs())


def test_a_bfloat16_model_keeps_the_router_and_its_bias_in_float32(tiny_model_factory):
    """As transformers' from_pretrained does: a bfloat16 router logit would move experts across the
    top-k boundary. The experts themselves are bfloat16."""
    from safetensors.torch import load_file

    model_dir = tiny_model_factory("deepseek-v3")
    checkpoint = {}
    for shard in model_dir.glob("*.safetensors"):
        checkpoint.update(load_file(str(shard)))
    cfg = ModelConfig.from_dir(model_dir)
    pipeline = Pipeline.load(cfg, WeightFiles(model_dir), [torch.device("cpu")] * 2, torch.bfloat16, cfg.max_position, "torch")
    sparse = [(stage, i, layer.moe) for stage in pipeline.stages for i, layer in enumerate(stage.layers) if layer.moe is not None]
    assert len(sparse) == 3  # layer 0 is dense (first_k_dense_replace 1)
    for stage, i, moe in sparse:
        prefix = f"model.layers.{stage.layer_ids[i]}.mlp.gate."
        assert moe.router.dtype == moe.e_score_correction_bias.dtype == torch.float32
        assert torch.equal(moe.router, checkpoint[prefix + "weight"])
        assert torch.equal(moe.e_score_correction_bias, checkpoint[prefix + "e_score_correction_bias"])
        assert moe.experts_gate_up.dtype == torch.bfloat16
