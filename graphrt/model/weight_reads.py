"""The weight bytes a decode step reads, which for a mixture of experts depends on its rows.

A dense layer reads all its weights every step. A sparse layer reads its attention, router and
shared expert every step, but of its routed experts only those some row chose. With E experts,
top-k and B rows routed uniformly, one expert goes unchosen by a row with probability 1 - k/E, so
a step reads E * (1 - (1 - k/E)^B) distinct experts on average: k at one row, nearly all E once
B * k is several times E. Real routers are not uniform (fewer distinct experts), so this is the
most a step reads on average, the right figure both to balance stages by and to state bandwidth
against. The partition weighs layers with it from the config (graphrt/runtime/pipeline.py); the
engine counts bytes with it from the loaded weights (`WeightReads`).
"""

from __future__ import annotations

from dataclasses import dataclass

from graphrt.model.config import ModelConfig


def expected_experts_read(num_experts: int, top_k: int, num_rows: int) -> float:
    """Distinct experts B = `num_rows` rows choose on average, each its top-k of E uniformly:
    E * (1 - (1 - k/E)^B)."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** num_rows)


def layer_read_elements(cfg: ModelConfig, layer: int, num_rows: int) -> float:
    """Weight elements layer `layer` reads in a decode step of `num_rows` rows: its projections,
    and a sparse layer's router, shared expert and expected experts (norms and biases are too small
    to count). An int for a dense layer, so dense models partition exactly as they always did."""
    attention = attention_elements(cfg)
    moe = cfg.moe
    if moe is None or not moe.is_sparse(layer):
        return attention + 3 * cfg.hidden_size * cfg.intermediate_size
    expert = 3 * cfg.hidden_size * moe.moe_intermediate_size
    experts = expected_experts_read(moe.num_experts, moe.num_experts_per_tok, num_rows) * expert
    router = moe.num_experts * cfg.hidden_size
    shared = 3 * cfg.hidden_size * moe.shared_expert_size
    shared_gate = cfg.hidden_size if moe.shared_expert_gated else 0
    return attention + router + shared + shared_gate + experts


def attention_elements(cfg: ModelConfig) -> int:
    """A layer's attention projections: q, k, v and o, or latent attention's (graphrt/model/mla.py)."""
    mla = cfg.mla
    if mla is None:
        return 2 * cfg.hidden_size * cfg.num_heads * cfg.head_dim + 2 * cfg.hidden_size * cfg.num_kv_heads * cfg.head_dim
    q_first = mla.q_lora_rank or cfg.num_heads * mla.qk_head_dim
    q_second = mla.q_lora_rank * cfg.num_heads * mla.qk_head_dim if mla.q_lora_rank else 0
    kv_b = mla.kv_lora_rank * cfg.num_heads * (mla.qk_nope_head_dim + mla.v_head_dim)
    return cfg.hidden_size * (q_first + mla.cache_dim) + q_second + kv_b + cfg.num_heads * mla.v_head_dim * cfg.hidden_size


def head_read_elements(cfg: ModelConfig) -> int:
    """The LM head's weight elements, read by the last stage every step."""
    return cfg.vocab_size * cfg.hidden_size


@dataclass(frozen=True)
class WeightReads:
    """The loaded weight bytes of one stage or several, split into what every decode step reads
    (`dense_bytes`) and the routed experts (`expert_bytes`, all experts of all sparse layers), of
    which a step reads the expected share. Stages add up; a dense model has no expert bytes."""

    dense_bytes: int
    expert_bytes: int = 0
    num_experts: int = 0
    top_k: int = 0
    bytes_per_expert: int = 0  # one routed expert's gate/up and down (every sparse layer's are alike)

    def at(self, num_rows: int) -> float:
        """Bytes a decode step of `num_rows` rows reads: the dense bytes (an int, exactly, for a
        dense model) plus the routed experts' bytes times the expected share of experts read."""
        if not self.expert_bytes:
            return self.dense_bytes
        share = expected_experts_read(self.num_experts, self.top_k, num_rows) / self.num_experts
        return self.dense_bytes + self.expert_bytes * share

    def __add__(self, other: WeightReads) -> WeightReads:
        experts = {(r.num_experts, r.top_k) for r in (self, other) if r.expert_bytes}
        if len(experts) > 1:
            raise ValueError(f"weight reads of different expert layouts (experts, top-k) {sorted(experts)} do not add up")
        num_experts, top_k = experts.pop() if experts else (0, 0)
        return WeightReads(
            self.dense_bytes + other.dense_bytes, self.expert_bytes + other.expert_bytes, num_experts, top_k,
            max(self.bytes_per_expert, other.bytes_per_expert),
        )

    @property
    def total_bytes(self) -> int:
        return self.dense_bytes + self.expert_bytes

    def decode_bytes(self, experts_read: int) -> int:
        """Bytes a decode step reads that read `experts_read` routed experts (what its routing chose,
        each sparse layer's distinct experts summed: Stage.seen_expert_reads), beside its dense bytes."""
        return self.dense_bytes + experts_read * self.bytes_per_expert

    def counting_note(self) -> str:
        """What a bandwidth figure built on `decode_bytes` counts, for a report line: nothing to add
        for a dense model (every weight, every step)."""
        if not self.expert_bytes:
            return ""
        return " (dense weights plus the experts each step's routing chose)"
