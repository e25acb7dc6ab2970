"""The sparse MLP of a mixture-of-experts layer (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3), pure torch
over a KernelSet.

A router picks each token's top-k experts (`route_topk`, softmax in float32 at least; DeepSeek-V3's
`route_grouped_topk`, sigmoid with a bias and expert groups); the set's `fused_moe` runs them and
sums their outputs by the routing weights. Qwen2-MoE adds a shared expert that every token runs,
scaled by sigmoid(shared_expert_gate(x)); DeepSeek-V3's shared experts (one MLP) are not gated.
Every shape follows from the number of tokens alone, so a decode step's graph holds the whole block.

Under expert parallelism (--ep N, issue 34) a layer holds only its rank's slice of the routed
experts (`ExpertShard`): every rank routes every token over all the experts, runs the pairs that
chose one of its own (the others get weight 0), and the shares are summed across the stage's ranks
by one collective (`combine`, an all-reduce). The shared experts, the router and everything outside
the block are replicated, so each rank's output is the whole layer's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from graphrt.kernels import KernelSet
from graphrt.kernels.moe import route_grouped_topk, route_topk
from graphrt.model.config import ModelConfig
from graphrt.profiling.nvtx import Ranges


@dataclass(frozen=True)
class ExpertShard:
    """Rank `rank` of the `size` ranks of a stage that split each sparse layer's routed experts:
    it holds the contiguous slice `experts` (the experts divide evenly: check_expert_parallel)."""

    rank: int = 0
    size: int = 1

    def experts(self, num_experts: int) -> range:
        per_rank = num_experts // self.size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)


WHOLE = ExpertShard()  # every expert, on one rank


def check_expert_parallel(cfg: ModelConfig, ep: int) -> None:
    """Refuse --ep N for a model whose routed experts can't be split evenly over N ranks."""
    if ep == 1:
        return
    if cfg.moe is None:
        raise ValueError(f"--ep {ep} splits a mixture of experts' routed experts over ranks, and {cfg.architecture} has none; drop --ep")
    num_experts = cfg.moe.num_experts
    if num_experts % ep:
        field = {"MixtralForCausalLM": "num_local_experts", "DeepseekV3ForCausalLM": "n_routed_experts"}.get(cfg.architecture, "num_experts")
        raise ValueError(
            f"--ep {ep} must divide the model's {num_experts} routed experts (config.json's {field}) evenly; "
            f"use one of {[n for n in range(1, num_experts + 1) if num_experts % n == 0]}"
        )


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: ExpertShard = WHOLE):
        super().__init__()
        moe = cfg.moe
        self.moe_cfg = moe
        self.experts = shard.experts(moe.num_experts)  # the routed experts this rank holds
        # Under expert parallelism, what sums the ranks' shares in place (an all-reduce over the
        # stage's ranks, set by the stage process); None on a single rank.
        self.combine: Callable[[torch.Tensor], None] | None = None
        self.ranges: Ranges | None = None  # with combine: NVTX ranges for its parts
        empty = lambda *shape: nn.Parameter(torch.empty(*shape, device="meta"), requires_grad=False)  # noqa: E731
        inter, shared = moe.moe_intermediate_size, moe.shared_expert_size
        self.router = empty(moe.num_experts, cfg.hidden_size)
        # DeepSeek-V3: added to the scores to choose experts, never to the weights
        self.e_score_correction_bias = empty(moe.num_experts) if moe.scoring == "sigmoid" else None
        # Experts stacked as fused_moe reads them: each expert's gate rows, then its up rows. A kernel
        # set may keep them one weight per expert instead, in a form of its own, indexed and shaped as
        # the stack (what its fused_moe reads).
        self.experts_gate_up = empty(len(self.experts), 2 * inter, cfg.hidden_size)
        self.experts_down = empty(len(self.experts), cfg.hidden_size, inter)
        self.shared_gate_up_proj = empty(2 * shared, cfg.hidden_size) if shared else None
        self.shared_down_proj = empty(cfg.hidden_size, shared) if shared else None
        self.shared_expert_gate = empty(1, cfg.hidden_size) if moe.shared_expert_gated else None
        # (num_experts,) int64 on the device, shared by the stage's sparse layers (Stage.load): the
        # tokens routed to each expert, for /metrics. None counts nothing (a layer built alone).
        self.expert_tokens: torch.Tensor | None = None
        # (1,) int64 on the device, shared likewise: the experts decode steps read, each sparse layer's
        # distinct experts a step's rows chose, for the weight bandwidth of `graphrt bench` and
        # `generate` (Engine._account). None counts nothing.
        self.expert_reads: torch.Tensor | None = None

    @staticmethod
    def hf_names(cfg: ModelConfig, layer: int, shard: ExpertShard = WHOLE) -> dict[str, list[str]]:
        """Our parameter -> the Hugging Face tensors concatenated (in order) to make it, as
        transformers writes them: one tensor per expert and projection (only the shard's experts).
        Concatenated, the experts' tensors are the stacked parameter with its first two dimensions
        merged (Stage.load reshapes)."""
        experts = shard.experts(cfg.moe.num_experts)
        if cfg.architecture == "MixtralForCausalLM":  # w1: gate, w3: up, w2: down
            p = f"model.layers.{layer}.block_sparse_moe."
            gate, up, down = "w1", "w3", "w2"
        else:
            p = f"model.layers.{layer}.mlp."
            gate, up, down = "gate_proj", "up_proj", "down_proj"
        expert = lambda e, proj: f"{p}experts.{e}.{proj}.weight"  # noqa: E731
        names = {
            "router": [p + "gate.weight"],
            "experts_gate_up": [expert(e, proj) for e in experts for proj in (gate, up)],
            "experts_down": [expert(e, down) for e in experts],
        }
        if cfg.moe.scoring == "sigmoid":
            names["e_score_correction_bias"] = [p + "gate.e_score_correction_bias"]
        if cfg.moe.shared_expert_size:
            shared = "shared_expert." if cfg.moe.shared_expert_gated else "shared_experts."  # Qwen2-MoE / DeepSeek-V3
            names["shared_gate_up_proj"] = [p + shared + "gate_proj.weight", p + shared + "up_proj.weight"]
            names["shared_down_proj"] = [p + shared + "down_proj.weight"]
        if cfg.moe.shared_expert_gated:
            names["shared_expert_gate"] = [p + "shared_expert_gate.weight"]
        return names

    def float32_at_least(self) -> tuple[str, ...]:
        """Parameters loaded in float32 when the model's dtype is narrower: DeepSeek-V3's router and
        bias, which transformers keeps in float32 (`_keep_in_fp32_modules_strict`) and routes with."""
        return ("router", "e_score_correction_bias") if self.moe_cfg.scoring == "sigmoid" else ()

    @staticmethod
    def stacked_hf_names(layer: int) -> dict[str, str]:
        """Our parameter -> its name in a checkpoint saved with transformers' in-memory names, where
        the experts are already stacked (gate rows before up rows) and Mixtral's block is `mlp` too."""
        p = f"model.layers.{layer}.mlp."
        return {
            "router": p + "gate.weight", "experts_gate_up": p + "experts.gate_up_proj", "experts_down": p + "experts.down_proj",
        }

    def forward(
        self, hidden: torch.Tensor, ops: KernelSet, real_tokens: torch.Tensor | None = None, decode: bool = False
    ) -> torch.Tensor:
        """hidden: (tokens, hidden_size); real_tokens: (tokens,) bool, False for a graph's padding
        rows, which are routed like any other but not counted in expert_tokens; `decode`: a decode
        step, whose experts read are counted in expert_reads."""
        topk_weights, topk_ids = self.route(hidden, ops)  # (tokens, top_k) each
        if self.expert_tokens is not None and real_tokens is not None:
            # index_add_ of a static shape: a graph holds it, and nothing is read back here
            per_choice = real_tokens.to(torch.int64)[:, None].expand(topk_ids.shape).reshape(-1)
            self.expert_tokens.index_add_(0, topk_ids.reshape(-1), per_choice)
            if decode and self.expert_reads is not None:
                # The distinct experts the rows chose, padding rows' too (their experts are read as
                # well), in a step with a real row: the start-up's all-padding steps count nothing.
                chosen = torch.zeros(self.moe_cfg.num_experts, dtype=torch.int64, device=hidden.device)
                self.expert_reads.add_(chosen.index_fill_(0, topk_ids.reshape(-1), 1).sum() * real_tokens.any())
        if self.combine is None:
            out = ops.fused_moe(hidden, self.experts_gate_up, self.experts_down, topk_weights, topk_ids)
        else:
            with self.ranges.experts("dispatch"):
                # This rank's pairs at their local index; another rank's at one past its last expert,
                # which fused_moe skips (the shapes stay static, so a graph holds it), at weight 0.
                local = topk_ids - self.experts.start
                mine = (local >= 0) & (local < len(self.experts))
                weights, local = torch.where(mine, topk_weights, 0.0), torch.where(mine, local, len(self.experts))
            with self.ranges.experts("run"):
                out = ops.fused_moe(hidden, self.experts_gate_up, self.experts_down, weights, local)
            with self.ranges.experts("combine"):
                self.combine(out)
        if self.shared_gate_up_proj is not None:
            shared = ops.linear(ops.gate_up_silu(hidden, self.shared_gate_up_proj), self.shared_down_proj)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(ops.linear(hidden, self.shared_expert_gate)) * shared
            out = out + shared
        return out

    def route(self, hidden: torch.Tensor, ops: KernelSet) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, hidden_size) -> (topk_weights (tokens, top_k) float32, float64 for a float64 model;
        topk_ids (tokens, top_k) int64)."""
        moe = self.moe_cfg
        if moe.scoring == "softmax":
            router_logits = ops.linear(hidden, self.router)  # (tokens, num_experts), in the model's dtype
            return route_topk(router_logits, moe.num_experts_per_tok, moe.norm_topk_prob)
        # DeepSeek-V3's router multiplies in float32 at least, as transformers' and DeepSeek's own code
        # do: a bfloat16 logit would move experts across the top-k boundary. A float64 model keeps
        # float64, whose rows round alike in any batch (a float32 GEMM's rounding can depend on the
        # row count, which a float64 model's padded and unpadded steps would show).
        wide = torch.promote_types(hidden.dtype, torch.float32)
        router_logits = ops.linear(hidden.to(wide), self.router.to(wide))
        return route_grouped_topk(
            router_logits, moe.num_experts_per_tok, self.e_score_correction_bias, moe.n_group, moe.topk_group,
            moe.norm_topk_prob, moe.routed_scaling_factor,
        )  # fmt: skip
