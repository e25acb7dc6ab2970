"""The weight bytes a decode step reads (graphrt/model/weight_reads.py): the expected number of
distinct experts against a Monte-Carlo count, and the engine's bandwidth figure, which for a mixture
of experts counts the experts a step's rows choose instead of all of them."""

from __future__ import annotations

import pytest
import torch

from graphrt import LLM, SamplingParams
from graphrt.model.weight_reads import WeightReads, expected_experts_read, head_read_elements, layer_read_elements


def distinct_experts_sampled(num_experts: int, top_k: int, num_rows: int, num_trials: int, seed: int) -> torch.Tensor:
    """Distinct experts per trial when each of `num_rows` rows picks `top_k` different experts uniformly."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(num_trials, num_rows, num_experts, generator=gen)
    chosen = scores.topk(top_k, dim=-1).indices  # (trials, rows, top_k): a uniform k-subset per row
    hit = torch.zeros(num_trials, num_experts, dtype=torch.bool)
    hit.scatter_(1, chosen.reshape(num_trials, -1), True)
    return hit.sum(dim=1).double()  # (trials,)


@pytest.mark.parametrize(("num_experts", "top_k", "num_rows"), [(16, 2, 1), (16, 2, 4), (16, 2, 32), (8, 2, 3), (60, 4, 7), (6, 3, 2)])
def test_expected_experts_equals_a_monte_carlo_count(num_experts, top_k, num_rows):
    counts = distinct_experts_sampled(num_experts, top_k, num_rows, num_trials=20000, seed=0)
    standard_error = counts.std().item() / counts.numel() ** 0.5
    expected = expected_experts_read(num_experts, top_k, num_rows)
    assert abs(counts.mean().item() - expected) <= 4 * standard_error + 1e-9
    assert top_k <= expected <= min(num_experts, top_k * num_rows)


def test_one_row_reads_its_top_k_and_many_rows_nearly_all():
    assert expected_experts_read(16, 2, 1) == pytest.approx(2)
    assert expected_experts_read(16, 2, 32) == pytest.approx(16 * (1 - (7 / 8) ** 32))
    assert expected_experts_read(16, 2, 1000) == pytest.approx(16)


def test_weight_reads_add_up_and_a_dense_model_reads_every_byte():
    dense = WeightReads(1000)
    assert dense.at(1) == dense.at(64) == 1000 and isinstance(dense.at(7), int) and dense.counting_note() == ""
    stage_0, stage_1 = WeightReads(100, 1600, 16, 2, 50), WeightReads(300, 800, 16, 2, 50)
    both = stage_0 + stage_1 + WeightReads(5)
    assert both == WeightReads(405, 2400, 16, 2, 50) and both.total_bytes == 2805
    assert both.at(1) == pytest.approx(405 + 2400 * 2 / 16)
    assert both.decode_bytes(3) == 405 + 3 * 50 and dense.decode_bytes(0) == 1000
    assert "the experts each step's routing chose" in both.counting_note()
    with pytest.raises(ValueError, match="different expert layouts"):
        stage_0 + WeightReads(1, 10, 8, 2)


def test_a_moe_models_bandwidth_counts_only_the_experts_its_steps_read(tiny_model_factory):
    llm = LLM(model=tiny_model_factory("mixtral"), pp=2, dtype="float32", kv_cache_tokens=256)
    engine = llm.engine
    reads = engine.weight_reads
    assert reads.total_bytes == engine.weight_bytes == sum(s.weight_bytes() for s in engine.pipeline.stages)
    # Mixtral's tiny variant: 4 sparse layers of 8 experts (2 * 80 + 80) x 64 floats each.
    assert (reads.num_experts, reads.top_k, reads.expert_bytes) == (8, 2, 4 * 8 * 3 * 80 * 64 * 4)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))  # one row a step
    stats = engine.stats
    assert stats.decode_steps == 5
    one_row = reads.dense_bytes + reads.expert_bytes * 2 / 8  # a row reads its top-2 of 8 experts
    assert stats.decode_weight_bytes == pytest.approx(5 * one_row)
    all_experts_gb_s = engine.weight_bytes * stats.decode_steps / stats.decode_seconds / 1e9
    assert stats.weight_gb_per_s() == pytest.approx(all_experts_gb_s * one_row / engine.weight_bytes)
    assert stats.weight_gb_per_s() < 0.6 * all_experts_gb_s  # the experts are most of this model's bytes


def test_a_dense_models_bandwidth_counts_every_weight_every_step(tiny_model_factory):
    llm = LLM(model=tiny_model_factory(), dtype="float32", kv_cache_tokens=256)
    llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    stats, engine = llm.engine.stats, llm.engine
    assert engine.weight_reads == WeightReads(engine.weight_bytes)
    assert stats.decode_steps > 0 and stats.decode_weight_bytes == engine.weight_bytes * stats.decode_steps
    assert stats.weight_gb_per_s() == engine.weight_bytes * stats.decode_steps / stats.decode_seconds / 1e9


@pytest.mark.parametrize("variant", ["mixtral", "qwen2-moe", "deepseek-v3", "deepseek-kimi-layout"])
def test_the_partition_weighs_the_weights_the_stages_load(tiny_model_factory, variant):
    """The partition weighs layers from the config before anything loads (layer_read_elements); those
    are the stages' loaded weights as a step of 8 rows reads them, less the norms and biases it leaves
    out, for every attention (latent attention's projections too) and mixture of experts."""
    llm = LLM(model=tiny_model_factory(variant), pp=2, dtype="float32", kv_cache_tokens=256)
    engine, cfg = llm.engine, llm.engine.model_config
    for stage, layers in zip(engine.pipeline.stages, engine.layers):
        left_out = sum(p.numel() for name, p in stage.named_parameters() if "norm" in name or name.endswith("bias"))
        weighed = sum(layer_read_elements(cfg, layer, 8) for layer in layers) + (head_read_elements(cfg) if stage.is_last else 0)
        assert stage.weight_reads().at(8) / 4 - left_out == pytest.approx(weighed, rel=1e-12)
