"""A CPU decode step's layers in one call (graphrt::decode_layers, kernels/cpu/csrc/decode_layers_cpu.cpp):
bitwise what the Python loop over DecoderLayer.forward computes, logits, KV cache and tokens per
expert alike, for plain Llama, Qwen2's q/k/v bias, Qwen3's per-head norms, the mixtures of experts
(Mixtral, Qwen2-MoE's gated shared expert, Qwen3-MoE, dense and sparse layers mixed) and
DeepSeek-V3's latent attention and grouped sigmoid routing (its layout and Kimi K2's); taken only
where every op is compiled and every matmul is in panels."""

from __future__ import annotations

import dataclasses
import random
import re
from pathlib import Path

import pytest
import torch

from graphrt import LLM, SamplingParams
from graphrt.kernels.cpu import stage_kernels
from graphrt.kernels.cpu.linear import can_use_panels
from graphrt.model.batch import StepMetadata
from graphrt.profiling.nvtx import Ranges
from graphrt.tools.synthetic import make_tiny_model

CPU = torch.device("cpu")
CONTEXTS = [1, 5, 16, 17, 40, 63]  # one token, within a block, a block exactly, across blocks


def llm_for(model, dtype: str, monkeypatch, kernels: str = "compiled", matmul: str = "panel") -> LLM:
    monkeypatch.setenv("GRAPHRT_CPU_KERNELS", kernels)
    monkeypatch.setenv("GRAPHRT_MATMUL", matmul)
    return LLM(model=model, dtype=dtype, kv_cache_tokens=1024, block_size=16, buckets=[len(CONTEXTS)])


def decode_step(llm: LLM, seed: int = 0, contexts: list[int] = CONTEXTS) -> tuple[torch.Tensor, StepMetadata]:
    """Token ids and metadata of a decode step over sequences of `contexts` tokens (this step's
    included), their earlier KV random, their blocks scattered over the cache."""
    engine, rng = llm.engine, random.Random(seed)
    block_size = engine.config.block_size
    free = engine.allocator.allocate(engine.allocator.num_free)
    rng.shuffle(free)
    tables, slots = [], []
    for context in contexts:
        blocks = [free.pop() for _ in range(-(-context // block_size))]
        tables.append(blocks)
        slots.append(blocks[(context - 1) // block_size] * block_size + (context - 1) % block_size)
    width = max(map(len, tables))
    generator = torch.Generator().manual_seed(seed)
    for cache in engine.pipeline.caches:
        cache.k.copy_(torch.randn(cache.k.shape, generator=generator))
        cache.v.copy_(torch.randn(cache.v.shape, generator=generator))
    meta = StepMetadata(
        positions=torch.tensor([c - 1 for c in contexts]),
        slot_mapping=torch.tensor(slots),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        seq_lens=torch.tensor(contexts),
        logits_indices=torch.arange(len(contexts)),
        seq_lens_host=list(contexts),
    )
    token_ids = torch.randint(0, engine.model_config.vocab_size, (len(contexts),), generator=generator)
    return token_ids, meta


def forward(llm: LLM, token_ids: torch.Tensor, meta: StepMetadata, one_call: bool, monkeypatch):
    """The stage's logits and its caches after the step, from the caches as they are now (left so);
    checks that graphrt::decode_layers ran (once) exactly where `one_call` says. A mixture of
    experts' tokens per expert are zeroed first."""
    stage, cache = llm.engine.pipeline.stages[0], llm.engine.pipeline.caches[0]
    stage.zero_expert_tokens()
    k, v = cache.k.clone(), cache.v.clone()
    calls = []
    op = torch.ops.graphrt.decode_layers
    with monkeypatch.context() as patch:
        patch.setattr(torch.ops.graphrt, "decode_layers", lambda *args: calls.append(1) or op(*args))
        if not one_call:
            patch.setattr(stage, "_decode_step", None)  # what the kernel set's decode_layers made
        with torch.inference_mode():
            logits = stage(token_ids, meta, cache)
    assert len(calls) == (1 if one_call else 0)
    after = cache.k.clone(), cache.v.clone()
    cache.k.copy_(k)
    cache.v.copy_(v)
    return logits, after


# Qwen3-MoE with layers 0 and 2 dense, experts whose gate/up halves are whole panels (32 columns).
MIXED_LAYERS = ("qwen3-moe-dense-first", {"moe_intermediate_size": 32})
# DeepSeek-V3 with an rms_norm_eps apart from its latent norms' (LATENT_NORM_EPS, 1e-6), so a norm
# given the other eps shows.
DEEPSEEK_V3 = ("deepseek-v3", {"rms_norm_eps": 1e-5})
KIMI_LAYOUT = ("deepseek-kimi-layout", {"rms_norm_eps": 1e-5})
ONE_CALL_VARIANTS = [
    "llama-gqa-tied", "qwen2-qkv-bias", "qwen3-qk-norm", "mixtral", "qwen2-moe", "qwen3-moe", MIXED_LAYERS, DEEPSEEK_V3,
    KIMI_LAYOUT,
]


def model_of(variant, tiny_model_factory, tmp_path):
    if isinstance(variant, tuple):
        name, overrides = variant
        return make_tiny_model(tmp_path, name, overrides=overrides)
    return tiny_model_factory(variant)


@pytest.mark.usefixtures("built_cpu_kernels")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("variant", ONE_CALL_VARIANTS, ids=lambda v: "-".join([v[0], *map(str, v[1])]) if isinstance(v, tuple) else v)
@pytest.mark.parametrize("rows", [1, len(CONTEXTS)])
def test_one_call_computes_bitwise_what_the_python_loop_does(tiny_model_factory, tmp_path, monkeypatch, variant, dtype, rows):
    if not can_use_panels(CPU, getattr(torch, dtype)):
        pytest.skip(f"the panel matmuls don't run {dtype} on this CPU")
    llm = llm_for(model_of(variant, tiny_model_factory, tmp_path), dtype, monkeypatch)
    stage = llm.engine.pipeline.stages[0]
    assert stage.decode_layers_in_one_call()
    assert "; a decode step's layers in one call (graphrt::decode_layers)" in llm.engine.kernel_summary()
    token_ids, meta = decode_step(llm, contexts=CONTEXTS[-rows:])
    padding = int(rows > 1)  # a row as a graph's bucket pads with: routed like the others, never counted per expert
    if padding:
        meta.slot_mapping[-1] = 3  # in block 0, the scratch block
    logits, (k, v) = forward(llm, token_ids, meta, one_call=True, monkeypatch=monkeypatch)
    expert_tokens, expert_reads = stage.seen_expert_tokens(), stage.seen_expert_reads()
    expected_logits, (expected_k, expected_v) = forward(llm, token_ids, meta, one_call=False, monkeypatch=monkeypatch)
    assert torch.equal(logits, expected_logits)
    assert torch.equal(k, expected_k) and torch.equal(v, expected_v)
    # The step wrote this step's K/V: the comparison above is not of two untouched caches.
    assert not torch.equal(k, llm.engine.pipeline.caches[0].k)
    assert expert_tokens == stage.seen_expert_tokens() and expert_reads == stage.seen_expert_reads()
    cfg = llm.engine.model_config
    if cfg.moe is not None:  # every real row of every sparse layer counted once per choice
        sparse = sum(layer.moe is not None for layer in stage.layers)
        assert sum(expert_tokens) == sparse * (rows - padding) * cfg.moe.num_experts_per_tok
        # each layer's distinct experts, padding row's too: k at one row (a row's top-k are distinct)
        assert cfg.moe.num_experts_per_tok * sparse <= expert_reads <= min(rows * cfg.moe.num_experts_per_tok, cfg.moe.num_experts) * sparse
        assert rows > 1 or expert_reads == cfg.moe.num_experts_per_tok * sparse


@pytest.mark.usefixtures("built_cpu_kernels")
def test_experts_not_in_panels_or_an_all_reduce_keep_the_python_loop(tiny_model_factory, monkeypatch):
    """qwen3-moe-dense-first's experts have 40 gate and 40 up columns (not whole panels): the loop
    runs the stage. A stage whose experts are summed over expert ranks (--ep) has its one call
    taken back when the all-reduce is set, and given back with it gone."""
    if not can_use_panels(CPU, torch.float32):
        pytest.skip("the panel matmuls don't run on this CPU")
    assert not llm_for(tiny_model_factory("qwen3-moe-dense-first"), "float32", monkeypatch).engine.pipeline.stages[0].decode_layers_in_one_call()
    stage = llm_for(tiny_model_factory("qwen3-moe"), "float32", monkeypatch).engine.pipeline.stages[0]
    assert stage.decode_layers_in_one_call()
    stage.combine_experts_with(lambda out: None, Ranges())
    assert not stage.decode_layers_in_one_call()
    stage.combine_experts_with(None, None)
    assert stage.decode_layers_in_one_call()


@pytest.mark.usefixtures("built_cpu_kernels")
@pytest.mark.parametrize(("kernels", "matmul"), [("torch", "panel"), ("compiled", "dense")])
def test_a_reference_op_or_a_dense_weight_keeps_the_python_loop(tiny_model_factory, monkeypatch, kernels, matmul):
    if not can_use_panels(CPU, torch.float32):
        pytest.skip("the panel matmuls don't run on this CPU")
    llm = llm_for(tiny_model_factory(), "float32", monkeypatch, kernels=kernels, matmul=matmul)
    assert not llm.engine.pipeline.stages[0].decode_layers_in_one_call()
    assert "in one call" not in llm.engine.kernel_summary()


@pytest.mark.usefixtures("built_cpu_kernels")
def test_the_op_names_what_a_call_lacks(tiny_model_factory, monkeypatch):
    if not can_use_panels(CPU, torch.float32):
        pytest.skip("the panel matmuls don't run on this CPU")
    llm = llm_for(tiny_model_factory(), "float32", monkeypatch)
    stage, cache = llm.engine.pipeline.stages[0], llm.engine.pipeline.caches[0]
    token_ids, meta = decode_step(llm)
    layers = stage.layers
    weights = [w for layer in layers for w in stage_kernels.layer_weights(layer)]
    per_layer = len(weights) // len(layers)
    slot = stage_kernels.LAYER_WEIGHTS.index

    def call(weights, experts=(), latent_dims=(), scoring="softmax"):
        torch.ops.graphrt.decode_layers(
            torch.randn(len(CONTEXTS), stage.cfg.hidden_size), weights, list(experts), None, None, stage.cos[meta.positions],
            stage.sin[meta.positions], cache.k, cache.v, meta.slot_mapping, meta.block_tables, meta.seq_lens,
            stage.cfg.num_heads, stage.cfg.num_kv_heads, stage.cfg.rms_norm_eps, layers[0].scale, list(latent_dims), 1e-6,
            scoring, 2, True, 1, 1, 1.0,
        )

    def with_weight(layer: int, offset: int, weight):
        changed = list(weights)
        changed[layer * per_layer + offset] = weight
        return changed

    num_layers = len(layers)
    with pytest.raises(RuntimeError, match=f"{per_layer * num_layers} weights \\({per_layer} a layer, None where absent\\) "
                                           f"for the caches' {num_layers} layers, got 2"):
        call(weights[:2])
    with pytest.raises(RuntimeError, match="layer 0 has a norm for q's heads or for k's but not both"):
        call(with_weight(0, slot("q_norm"), layers[0].input_norm))
    with pytest.raises(RuntimeError, match="layer 1 has a gate/up weight or a down weight but not both"):
        call(with_weight(1, slot("mlp.gate_up"), None))
    for name in ("input_norm", "post_attention_norm", "o_proj"):  # what every layer has
        with pytest.raises(RuntimeError, match=f"layer 0 lacks its {name}$"):
            call(with_weight(0, slot(name), None))
    with pytest.raises(RuntimeError, match="scoring is softmax or sigmoid, not cosine"):
        call(weights, scoring="cosine")
    router = slot("moe.router")
    with pytest.raises(RuntimeError, match="the routers name 8 expert weights \\(a gate/up and a down per expert\\), got 0"):
        call(with_weight(0, router, torch.zeros(4, stage.cfg.hidden_size)))
    with pytest.raises(RuntimeError, match="layer 0 routes by sigmoid scores but has no bias"):
        call(with_weight(0, router, torch.zeros(4, stage.cfg.hidden_size)), scoring="sigmoid")


def test_the_op_and_the_binding_list_a_layers_weights_in_one_order():
    """The op reads each layer's weights by slot (its LayerWeight enum, named in kLayerWeightNames);
    stage_kernels.LAYER_WEIGHTS is what the binding fills them from."""
    source = (Path(stage_kernels.__file__).parent / "csrc" / "decode_layers_cpu.cpp").read_text()
    names = re.search(r"kLayerWeightNames\[kPerLayer\] = \{(.*?)\};", source, re.S).group(1)
    assert re.findall(r'"([^"]+)"', names) == list(stage_kernels.LAYER_WEIGHTS)
    enum = re.search(r"enum LayerWeight : int64_t \{(.*?)\};", source, re.S).group(1)
    slots = [line.strip().rstrip(",").split()[0] for line in enum.splitlines() if line.strip().startswith("k")]
    assert slots[-1] == "kPerLayer" and len(slots) - 1 == len(stage_kernels.LAYER_WEIGHTS)


@pytest.mark.usefixtures("built_cpu_kernels")
@pytest.mark.parametrize("kernels", ["compiled", "torch"])
def test_the_python_loop_ends_gate_up_in_silu_and_mul_where_that_op_is_compiled(tiny_model_factory, monkeypatch, kernels):
    if not can_use_panels(CPU, torch.float32):
        pytest.skip("the panel matmuls don't run on this CPU")
    llm = llm_for(tiny_model_factory(), "float32", monkeypatch, kernels=kernels)
    layers = llm.engine.pipeline.stages[0].layers
    token_ids, meta = decode_step(llm)
    fused_calls = []
    fused_op = stage_kernels.panel_linear_silu_and_mul
    monkeypatch.setattr(stage_kernels, "panel_linear_silu_and_mul", lambda *a: fused_calls.append(1) or fused_op(*a))
    logits, caches = forward(llm, token_ids, meta, one_call=False, monkeypatch=monkeypatch)
    assert len(fused_calls) == (len(layers) if kernels == "compiled" else 0)
    if kernels == "compiled":
        for layer in layers:  # the same kernels, gate/up's matmul and silu_and_mul as two calls
            ops = layer.ops
            unfused = dataclasses.replace(ops, gate_up_silu=lambda x, weight, ops=ops: ops.silu_and_mul(ops.linear(x, weight)))
            monkeypatch.setattr(layer, "ops", unfused)
        unfused_logits, unfused_caches = forward(llm, token_ids, meta, one_call=False, monkeypatch=monkeypatch)
        assert len(fused_calls) == len(layers)
        assert torch.equal(unfused_logits, logits) and all(map(torch.equal, unfused_caches, caches))


@pytest.mark.usefixtures("built_cpu_kernels")
@pytest.mark.parametrize("variant", ["llama-gqa-tied", "qwen2-moe", "deepseek-v3"])
def test_two_stages_in_one_call_each_generate_what_one_stage_and_the_loop_do(tiny_model_factory, monkeypatch, variant):
    """Through the engine (graphs' padding rows, the ring, KV over several blocks): one stage and two
    in one call each, and one stage in the Python loop, greedy alike."""
    if not can_use_panels(CPU, torch.float32):
        pytest.skip("the panel matmuls don't run on this CPU")
    monkeypatch.setenv("GRAPHRT_MATMUL", "panel")
    prompts = [[5, 9, 2, 41], list(range(3, 40)), [7] * 20]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = {}
    for pp, kernels in ((1, "compiled"), (2, "compiled"), (1, "compiled,decode_layers=off")):
        monkeypatch.setenv("GRAPHRT_CPU_KERNELS", kernels)
        llm = LLM(model=tiny_model_factory(variant), pp=pp, dtype="float32", kv_cache_tokens=1024, block_size=16)
        try:
            one_call = "off" not in kernels
            assert all(stage.decode_layers_in_one_call() is one_call for stage in llm.engine.pipeline.stages)
            outputs[pp, one_call] = [out.token_ids for out in llm.generate(prompts, params)]
        finally:
            llm.engine.close()
    assert outputs[1, True] == outputs[2, True] == outputs[1, False]
    assert all(len(tokens) == 12 for tokens in outputs[1, True])


@pytest.mark.usefixtures("built_cpu_kernels")
def test_up_columns_that_are_not_whole_panels_keep_the_two_ops(tmp_path, monkeypatch):
    """intermediate_size 40: gate/up's 80 columns are 5 panels, so up does not start on a panel."""
    if not can_use_panels(CPU, torch.float32):
        pytest.skip("the panel matmuls don't run on this CPU")
    llm = llm_for(make_tiny_model(tmp_path, "llama-gqa-tied", overrides={"intermediate_size": 40}), "float32", monkeypatch)
    stage = llm.engine.pipeline.stages[0]
    assert stage.layers[0].gate_up_proj.dim() == 4 and stage.layers[0].gate_up_proj.shape[0] == 5
    assert not stage.decode_layers_in_one_call()
    fused_calls = []
    fused_op = stage_kernels.panel_linear_silu_and_mul
    monkeypatch.setattr(stage_kernels, "panel_linear_silu_and_mul", lambda *a: fused_calls.append(1) or fused_op(*a))
    tokens = llm.generate([[5, 9, 2, 41]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].token_ids
    assert len(tokens) == 6 and fused_calls == []
