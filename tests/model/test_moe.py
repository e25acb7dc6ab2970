"""Mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE): routing and the experts' sum against their
plain definitions and transformers, configs read and refused as transformers' classes write them,
experts loaded from either checkpoint layout, and a graph-unsafe expert loop named by the rehearsal.

The whole-model checks run in the suites every variant goes through (TINY_VARIANTS): logits against
transformers at pp 1-3 and greedy tokens in float64 (test_tiny_parity.py), informative outputs
(test_informative_models.py), and the capture rehearsal with both kernel sets (test_rehearsal.py).
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import save_file

from graphrt import LLM, SamplingParams
from graphrt.capture.graphs import StaticInputs
from graphrt.capture.rehearsal import RehearsalError, rehearse_stage
from graphrt.errors import ModelLoadError
from graphrt.kernels.cpu.moe import fused_moe_by_expert
from graphrt.kernels.moe import fused_moe, route_topk
from graphrt.model.config import ModelConfig
from graphrt.model.moe import ExpertShard
from graphrt.model.weights import WeightFiles
from graphrt.runtime.pipeline import Pipeline
from graphrt.runtime.stage_builder import load_stage
from helpers import hf_model, prompt_logits

MOE_VARIANTS = ["mixtral", "qwen2-moe", "qwen3-moe", "qwen3-moe-dense-first"]


def per_token_loop(hidden, w_gate_up, w_down, topk_weights, topk_ids) -> torch.Tensor:
    """fused_moe's definition, one token and one choice at a time."""
    inter = w_down.shape[2]
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    for t in range(hidden.shape[0]):
        x = hidden[t].double()
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            gate, up = w_gate_up[e, :inter].double() @ x, w_gate_up[e, inter:].double() @ x
            out[t] += float(topk_weights[t, k]) * (w_down[e].double() @ (F.silu(gate) * up))
    return out


# (tokens, top_k, experts): experts that divide neither tokens nor sizes, top-k 1 and 8 (more choices
# than experts, so rows repeat experts), buckets 1 to 64. Fewer (token, k) pairs than experts runs
# the gathered form; the others the every-expert form.
SHAPES = [(1, 1, 13), (1, 8, 13), (3, 2, 13), (1, 8, 3), (5, 8, 3), (17, 1, 13), (33, 2, 7), (64, 8, 13), (64, 1, 5)]


@pytest.mark.parametrize("fused_moe", [fused_moe, fused_moe_by_expert], ids=["reference", "cpu-by-expert"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize(("num_tokens", "top_k", "num_experts"), SHAPES)
def test_fused_moe_equals_a_per_token_loop(num_tokens, top_k, num_experts, dtype, fused_moe):
    hidden_size, inter = 40, 24
    gen = torch.Generator().manual_seed(num_tokens * 100 + top_k * 10 + num_experts)
    hidden = torch.randn(num_tokens, hidden_size, generator=gen).to(dtype)
    w_gate_up = (torch.randn(num_experts, 2 * inter, hidden_size, generator=gen) * 0.2).to(dtype)
    w_down = (torch.randn(num_experts, hidden_size, inter, generator=gen) * 0.2).to(dtype)
    topk_weights = torch.rand(num_tokens, top_k, generator=gen)  # float32, as the routers make them
    topk_ids = torch.randint(0, num_experts, (num_tokens, top_k), generator=gen)  # with repeats
    if top_k > 1:
        topk_ids[0, 1] = topk_ids[0, 0]  # a row that names one expert twice
    out = fused_moe(hidden, w_gate_up, w_down, topk_weights, topk_ids)
    assert out.shape == (num_tokens, hidden_size) and out.dtype == dtype
    tolerance = 1e-12 if dtype == torch.float64 else 2e-5
    expected = per_token_loop(hidden, w_gate_up, w_down, topk_weights, topk_ids)
    torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=0)


@pytest.mark.parametrize("fused_moe", [fused_moe, fused_moe_by_expert], ids=["reference", "cpu-by-expert"])
@pytest.mark.parametrize("num_tokens", [1, 6], ids=["gathered", "every-expert"])  # 2 or 12 pairs, 4 experts
def test_another_expert_ranks_pairs_add_nothing(num_tokens, fused_moe):
    """Under --ep another rank's pairs come as id num_experts at weight 0 (graphrt/model/moe.py): they
    add nothing, even where the expert they would land on overflows."""
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(num_tokens, 16, generator=gen, dtype=torch.float64)
    w_gate_up, w_down = torch.randn(4, 20, 16, generator=gen, dtype=torch.float64), torch.randn(4, 16, 10, generator=gen, dtype=torch.float64)
    topk_ids = torch.tensor([[1, 4]] * num_tokens)  # expert 1, and one held elsewhere
    topk_weights = torch.tensor([[0.75, 0.0]] * num_tokens)
    expected = per_token_loop(hidden, w_gate_up, w_down, topk_weights[:, :1], topk_ids[:, :1])
    w_gate_up[3], w_down[3] = torch.inf, torch.inf  # the last expert, which a clamped id would run
    torch.testing.assert_close(fused_moe(hidden, w_gate_up, w_down, topk_weights, topk_ids), expected, atol=1e-12, rtol=0)


@pytest.mark.parametrize("num_tokens", [1, 6], ids=["gathered", "every-expert"])  # 2 or 12 pairs, 4 experts
def test_an_expert_no_row_chose_changes_nothing(num_tokens):
    """The gathered form never reads an expert no row chose; the every-expert form runs it and keeps
    none of it, even where it overflows (half precision can): NaN weights there leave every bit as
    it was in both."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(num_tokens, 16, generator=gen)
    w_gate_up, w_down = torch.randn(4, 20, 16, generator=gen), torch.randn(4, 16, 10, generator=gen)
    topk_ids = torch.tensor([[2, 0]] * num_tokens)
    topk_weights = torch.rand(num_tokens, 2, generator=gen)
    clean = fused_moe(hidden, w_gate_up, w_down, topk_weights, topk_ids)
    w_gate_up[[1, 3]], w_down[[1, 3]] = torch.nan, torch.nan
    assert torch.equal(fused_moe(hidden, w_gate_up, w_down, topk_weights, topk_ids), clean)


@pytest.mark.parametrize("family", ["mixtral", "qwen3-moe-normalized", "qwen2-moe"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_routing_matches_transformers_routers(family, dtype):
    # Imported here: transformers' modeling modules import triton, which must not happen while pytest
    # collects, before test_rehearsal.py sets TRITON_INTERPRET=1 for the Triton kernels.
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    # family -> transformers' config class and router, its options, and whether it renormalizes
    config_cls, router_cls, options, renormalize = {
        "mixtral": (transformers.MixtralConfig, MixtralTopKRouter, {}, True),
        "qwen3-moe-normalized": (transformers.Qwen3MoeConfig, Qwen3MoeTopKRouter, {"norm_topk_prob": True}, True),
        "qwen2-moe": (transformers.Qwen2MoeConfig, Qwen2MoeTopKRouter, {"norm_topk_prob": False}, False),
    }[family]
    router = router_cls(config_cls(hidden_size=32, num_experts=7, num_experts_per_tok=3, **options)).to(dtype)
    assert router.num_experts == 7
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen))
        hidden = torch.randn(50, 32, generator=gen).to(dtype)
        _, hf_weights, hf_ids = router(hidden)
    weights, ids = route_topk(F.linear(hidden, router.weight), top_k=3, renormalize=renormalize)
    assert torch.equal(ids, hf_ids)
    if dtype == torch.float64:
        # graphrt's softmax keeps float64 (a float32 one turns last-bit differences into float32
        # steps), transformers' rounds to float32
        assert weights.dtype == torch.float64
        torch.testing.assert_close(weights, hf_weights.double(), atol=1e-6, rtol=0)
    else:
        assert weights.dtype == torch.float32
        # Qwen's routers hand the weights on in the model's dtype, Mixtral's in float32.
        assert torch.equal(weights.to(hf_weights.dtype), hf_weights)
    if renormalize:
        torch.testing.assert_close(weights.sum(-1), torch.ones(50, dtype=weights.dtype))


def hf_config_dict(config) -> dict:
    """What transformers writes to config.json for `config`."""
    return json.loads(config.to_json_string(use_diff=False))


@pytest.mark.parametrize(("mlp_only_layers", "decoder_sparse_step"), [([], 1), ([0], 1), ([0, 3], 2), ([5], 3), ([], 4)])
@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe"])
def test_sparse_layers_are_the_ones_transformers_builds(family, mlp_only_layers, decoder_sparse_step):
    config_cls, arch = {
        "qwen2_moe": (transformers.Qwen2MoeConfig, "Qwen2MoeForCausalLM"),
        "qwen3_moe": (transformers.Qwen3MoeConfig, "Qwen3MoeForCausalLM"),
    }[family]
    config = config_cls(
        vocab_size=32, hidden_size=16, intermediate_size=24, moe_intermediate_size=8, shared_expert_intermediate_size=8,
        num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1, num_experts=4, num_experts_per_tok=2,
        mlp_only_layers=mlp_only_layers, decoder_sparse_step=decoder_sparse_step, architectures=[arch],
    )
    hf_layers = transformers.AutoModelForCausalLM.from_config(config).model.layers
    hf_sparse = [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in hf_layers]
    ours = ModelConfig.from_hf(hf_config_dict(config))
    assert [ours.moe.is_sparse(layer) for layer in range(6)] == hf_sparse
    assert ours.moe.moe_intermediate_size == 8 and ours.intermediate_size == 24


def test_moe_config_reads_each_familys_names(tiny_model_factory):
    mixtral = ModelConfig.from_dir(tiny_model_factory("mixtral"))
    moe = mixtral.moe
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size, moe.norm_topk_prob) == (8, 2, 80, True)
    assert all(mixtral.moe.is_sparse(layer) for layer in range(mixtral.num_layers))
    qwen2 = ModelConfig.from_dir(tiny_model_factory("qwen2-moe"))
    assert (qwen2.moe.shared_expert_intermediate_size, qwen2.moe.norm_topk_prob, qwen2.qkv_bias) == (48, False, True)
    # transformers writes Qwen3-MoE's expert count as num_local_experts; Qwen's own configs say num_experts.
    raw = json.loads((tiny_model_factory("qwen3-moe") / "config.json").read_text())
    assert "num_local_experts" in raw
    raw["num_experts"] = raw.pop("num_local_experts")
    assert ModelConfig.from_hf(raw) == ModelConfig.from_dir(tiny_model_factory("qwen3-moe"))
    assert ModelConfig.from_hf(raw).moe.norm_topk_prob and ModelConfig.from_hf(raw).moe.shared_expert_intermediate_size == 0


# (variant, fields to set in its config.json, the field the error must name)
REFUSED = [
    ("mixtral", {"hidden_act": "gelu"}, "hidden_act"),
    ("qwen3-moe", {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}, "quantization_config"),
    ("qwen3-moe", {"attention_bias": True}, "attention_bias"),
    ("qwen3-moe-dense-first", {"decoder_sparse_step": 0}, "decoder_sparse_step"),
    ("qwen2-moe", {"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ("mixtral", {"num_experts_per_tok": 0}, "num_experts_per_tok"),
    ("qwen2-moe", {"moe_intermediate_size": None}, "moe_intermediate_size"),  # None: the field removed
]


@pytest.mark.parametrize(("variant", "fields", "named"), REFUSED, ids=[f"{v}-{n}" for v, _, n in REFUSED])
def test_a_config_graphrt_does_not_implement_is_refused_naming_the_field(tiny_model_factory, variant, fields, named):
    raw = json.loads((tiny_model_factory(variant) / "config.json").read_text())
    for field, value in fields.items():
        if value is None:
            del raw[field]
        else:
            raw[field] = value
    with pytest.raises(ModelLoadError, match=named):
        ModelConfig.from_hf(raw)


def test_router_jitter_noise_is_ignored_as_transformers_does_at_inference(tiny_model_factory):
    raw = json.loads((tiny_model_factory("mixtral") / "config.json").read_text())
    assert ModelConfig.from_hf({**raw, "router_jitter_noise": 0.1}) == ModelConfig.from_hf(raw)


def save_stacked(model_dir, out_dir):
    """The model as transformers holds it in memory: each layer's experts stacked in one tensor."""
    out_dir.mkdir()
    shutil.copy(model_dir / "config.json", out_dir / "config.json")
    state = {name: t.contiguous() for name, t in hf_model(model_dir, torch.float32).state_dict().items()}
    assert any(name.endswith("mlp.experts.gate_up_proj") for name in state)
    save_file(state, str(out_dir / "model.safetensors"))
    return out_dir


@pytest.mark.parametrize("variant", ["mixtral", "qwen2-moe"])
def test_experts_stored_stacked_load_as_experts_stored_one_by_one(tiny_model_factory, tmp_path, variant, monkeypatch):
    """transformers writes one tensor per expert; a checkpoint saved under its in-memory names holds
    them stacked (and Mixtral's block as `mlp`). Both load every parameter of every stage bit for
    bit (kept dense here, so they compare), and give the same logits (to rounding: the two engines'
    thread teams may differ in size, and a CPU matmul's sums with them)."""
    monkeypatch.setenv("GRAPHRT_MATMUL", "dense")
    model_dir = tiny_model_factory(variant)
    stacked_dir = save_stacked(model_dir, tmp_path / "stacked")
    one_by_one, stacked = (LLM(model=d, pp=2, dtype="float32", kv_cache_tokens=128).engine for d in (model_dir, stacked_dir))
    for ours, theirs in zip(one_by_one.pipeline.stages, stacked.pipeline.stages):
        ours, theirs = dict(ours.named_parameters()), dict(theirs.named_parameters())
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[name], theirs[name]) for name in ours), [n for n in ours if not torch.equal(ours[n], theirs[n])]
    prompt = list(range(3, 20))
    torch.testing.assert_close(prompt_logits(one_by_one, prompt), prompt_logits(stacked, prompt), atol=1e-5, rtol=0)


def test_an_expert_rank_reads_only_its_rows_of_stacked_experts(tiny_model_factory, tmp_path, monkeypatch):
    """Under --ep a rank reads its slice of a stacked tensor from the file, not the whole: each
    rank's experts equal the same experts stored one by one, and nothing reads the stacked tensor whole."""
    model_dir = tiny_model_factory("mixtral")
    stacked_dir = save_stacked(model_dir, tmp_path / "stacked")
    cfg = ModelConfig.from_dir(model_dir)
    read_whole = []
    real_open = WeightFiles._open

    class Recording:  # a shard's handle that notes each tensor read whole
        def __init__(self, handle):
            self.handle = handle

        def keys(self):
            return self.handle.keys()

        def get_slice(self, name):
            return self.handle.get_slice(name)

        def get_tensor(self, name):
            read_whole.append(name)
            return self.handle.get_tensor(name)

    monkeypatch.setattr(WeightFiles, "_open", staticmethod(lambda path: Recording(real_open(path))))
    for rank in range(4):
        shard = ExpertShard(rank, 4)
        stages = [
            load_stage(cfg, 0, 1, range(cfg.num_layers), torch.device("cpu"), torch.float32, 64, "torch", WeightFiles(d), shard)
            for d in (model_dir, stacked_dir)
        ]
        for name in ("experts_gate_up", "experts_down"):
            ours, theirs = (getattr(stage.layers[1].moe, name) for stage in stages)
            assert ours.shape[0] == 2 and torch.equal(ours, theirs), (rank, name)
    assert not [name for name in read_whole if name.endswith(("experts.gate_up_proj", "experts.down_proj"))]


@pytest.mark.parametrize("variant", MOE_VARIANTS)
def test_a_routing_bug_moves_logits_far_beyond_the_parity_tolerance(tiny_model_factory, variant):
    """The parity tests hold graphrt to 1e-4 of transformers; each of these routing bugs moves the
    tiny models' logits by far more, so they would fail: the experts and their weights matter."""
    model_dir = tiny_model_factory(variant)
    prompt = list(range(10, 33))
    llm = LLM(model=model_dir, dtype="float32", kv_cache_tokens=128, prefix_caching=False)  # every run computes the whole prompt
    healthy = prompt_logits(llm.engine, prompt)
    bugs = {
        "next expert": lambda ids, weights, num: ((ids + 1) % num, weights),
        "weights swapped between choices": lambda ids, weights, num: (ids, weights.flip(-1)),
    }
    for bug_name, bug in bugs.items():
        for stage in llm.engine.pipeline.stages:
            for layer in stage.layers:
                if layer.moe is None:
                    continue

                def buggy(hidden, w_gate_up, w_down, weights, ids, bug=bug, real=stage.ops.fused_moe):
                    ids, weights = bug(ids, weights, w_gate_up.shape[0])
                    return real(hidden, w_gate_up, w_down, weights, ids)

                layer.ops = dataclasses.replace(stage.ops, fused_moe=buggy)
        broken = prompt_logits(llm.engine, prompt)
        for stage in llm.engine.pipeline.stages:
            for layer in stage.layers:
                layer.ops = stage.ops
        assert (broken - healthy).abs().max() > 1e-2, f"{bug_name} left {variant}'s logits within 1e-2"


def transformers_style_experts(hidden, w_gate_up, w_down, topk_weights, topk_ids):
    """The experts loop as transformers' eager implementation writes it: only the experts some token
    chose, found with nonzero and where(mask), whose sizes depend on the routing."""
    out = torch.zeros_like(hidden)
    hit = F.one_hot(topk_ids, w_gate_up.shape[0]).sum((0, 1)).nonzero()
    for expert in hit.flatten().tolist():
        rows, picks = torch.where(topk_ids == expert)
        gate, up = F.linear(hidden[rows], w_gate_up[expert]).chunk(2, dim=-1)
        out.index_add_(0, rows, F.linear(F.silu(gate) * up, w_down[expert]) * topk_weights[rows, picks, None])
    return out


def test_rehearsal_names_a_data_dependent_experts_loop(tiny_model_factory):
    model_dir = tiny_model_factory("qwen3-moe-dense-first")
    cfg = ModelConfig.from_dir(model_dir)
    pipeline = Pipeline.load(cfg, WeightFiles(model_dir), [torch.device("cpu")] * 2, torch.float32, cfg.max_position, "torch")
    pipeline.allocate_kv(8, 16)
    stage, cache = pipeline.stages[1], pipeline.caches[1]
    inputs = lambda: StaticInputs.allocate(stage, 4, max_blocks=cfg.max_position // 16)  # noqa: E731
    rehearse_stage(stage, cache, inputs())  # the static-shape fused_moe passes
    sparse = [layer for layer in stage.layers if layer.moe is not None]
    assert sparse, "stage 1 of qwen3-moe-dense-first holds a sparse layer"
    sparse[0].ops = dataclasses.replace(stage.ops, fused_moe=transformers_style_experts)
    with pytest.raises(RehearsalError, match=r"^stage 1, bucket 4: aten\.nonzero"):
        rehearse_stage(stage, cache, inputs())


def test_expert_load_counts_each_token_the_experts_transformers_routes_it_to(tiny_model_factory):
    """Each stage's tokens per expert: every prompt token and every token fed back, once per sparse
    layer and choice, none of a graph's padding rows (5 requests over 2 ring slots ride buckets of 4
    rows with 1 or 2 rows) nor of the capture's verification. transformers' router logits for the
    same tokens give the same experts."""
    model_dir = tiny_model_factory("mixtral")
    prompts = [[5, 9, 13], list(range(20, 45)), [1, 2], [7, 8, 9, 10], [3]]
    llm = LLM(model=model_dir, pp=2, depth=0, dtype="float64", kv_cache_tokens=512, buckets=[1, 4], prefix_caching=False)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=9, temperature=0, ignore_eos=True))
    hf = hf_model(model_dir, torch.float64)
    cfg, layers = llm.engine.model_config, llm.engine.layers
    expected = [[0] * cfg.moe.num_experts for _ in layers]
    for prompt, output in zip(prompts, outputs):
        fed = torch.tensor([prompt + output.token_ids[:-1]])  # the last token is never fed back
        with torch.no_grad():
            router_logits = hf(fed, output_router_logits=True).router_logits  # per layer: (tokens, experts)
        for stage, layer_ids in enumerate(layers):
            for layer in layer_ids:
                for expert in router_logits[layer].topk(cfg.moe.num_experts_per_tok, dim=-1).indices.flatten().tolist():
                    expected[stage][expert] += 1
    assert llm.engine.ring.stage_expert_tokens == expected
    assert min(min(counts) for counts in expected) < max(max(counts) for counts in expected)  # an uneven load


@pytest.mark.parametrize("procs", [False, True])
def test_each_decode_step_counts_the_experts_its_rows_chose(tiny_model_factory, procs):
    """One request at a time: each decode step's one row reads its top-k experts (distinct) in each
    sparse layer of each stage, the prompt chunks and the start-up's steps of padding rows count
    none, and the weight bytes the engine counts for decode (its bandwidth figure) are each step's
    dense bytes plus those experts'. Stage 1 in a process of its own reports its count with its
    replies."""
    llm = LLM(model=tiny_model_factory("qwen2-moe"), pp=2, procs=procs, dtype="float32", kv_cache_tokens=512, prefix_caching=False)
    try:
        engine = llm.engine
        assert engine.ring.stage_expert_reads == [0, 0]
        params = SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)
        for prompt in ([5, 9, 13], list(range(20, 45))):
            llm.generate([prompt], params)
        cfg, stats, reads = engine.model_config, engine.stats, engine.weight_reads
        sparse = [sum(cfg.moe.is_sparse(layer) for layer in layers) for layers in engine.layers]
        assert stats.decode_steps == 2 * 8
        assert engine.ring.stage_expert_reads == [stats.decode_steps * cfg.moe.num_experts_per_tok * n for n in sparse]
        experts_read = sum(engine.ring.stage_expert_reads)
        assert stats.decode_weight_bytes == stats.decode_steps * reads.dense_bytes + experts_read * reads.bytes_per_expert
        assert reads.bytes_per_expert * cfg.moe.num_experts * sum(sparse) == reads.expert_bytes
        assert "the experts each step's routing chose" in reads.counting_note()
    finally:
        llm.engine.close()
