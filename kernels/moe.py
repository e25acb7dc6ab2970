"""Mixture of experts: top-k routing and the experts' gated MLPs, as torch references.

`route_topk` (softmax: Mixtral, Qwen) and `route_grouped_topk` (sigmoid, bias and expert groups:
DeepSeek-V3) turn router logits into each token's chosen experts and their weights; `fused_moe`
runs the chosen experts and sums their outputs by those weights. Both keep every shape fixed by the
input shapes alone (no nonzero, no boolean masks, no counts read on the host), so a CUDA graph
holds them. A Triton `fused_moe` with the same signature is the fast path (issue 32); this one
defines what it must compute.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def route_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, num_experts) logits -> (topk_weights (tokens, top_k) float32, float64 for a float64
    model; topk_ids (tokens, top_k) int64).

    The softmax runs in float32 at least, as Mixtral's and Qwen's routers in transformers do: which
    experts a token reaches must not depend on bfloat16 rounding. A float64 model keeps float64
    (transformers rounds to float32 there too): a float32 softmax of float64 logits that differ in
    their last bits, as a row's do in a padded and an unpadded batch, can land a float32 step apart,
    and capture's float64 check (1e-10) then refused a correct stage. With
    `renormalize` the chosen weights are divided by their sum (Mixtral always; Qwen per
    `norm_topk_prob`), else they stay the softmax's probabilities."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.promote_types(router_logits.dtype, torch.float32))
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids


def route_grouped_topk(
    router_logits: torch.Tensor,  # (tokens, num_experts)
    top_k: int,
    e_score_correction_bias: torch.Tensor,  # (num_experts,)
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's routing (Kimi K2's too): (tokens, num_experts) logits -> (topk_weights (tokens,
    top_k) float32, float64 for a float64 model; topk_ids (tokens, top_k) int64).

    Scores are sigmoid(logits) in float32 at least (float64 stays float64, as in `route_topk`). The
    bias (trained to balance the experts' load) steers only which experts are chosen: the experts
    fall into `n_group` equal groups, each group is scored
    by the sum of its two best biased scores, and only the experts of the `topk_group` best groups
    are eligible for the top-k. The weights are the chosen experts' unbiased scores, divided by their
    sum with `norm_topk_prob`, then times `routed_scaling_factor`. Groups are masked with a tensor
    of the logits' shape (masked_fill), never selected by indexing, so every shape follows from the
    number of tokens and a graph holds the routing."""
    num_tokens, num_experts = router_logits.shape
    wide = torch.promote_types(router_logits.dtype, torch.float32)
    scores = torch.sigmoid(router_logits.to(wide))  # (tokens, num_experts)
    biased = scores + e_score_correction_bias.to(wide)
    per_group = biased.view(num_tokens, n_group, num_experts // n_group)
    group_scores = per_group.topk(2, dim=-1).values.sum(dim=-1)  # (tokens, n_group)
    best_groups = group_scores.topk(topk_group, dim=-1).indices  # (tokens, topk_group)
    group_chosen = torch.zeros_like(group_scores).scatter_(1, best_groups, 1.0)
    expert_eligible = group_chosen.unsqueeze(-1).expand_as(per_group).reshape(num_tokens, num_experts)
    biased = biased.masked_fill(expert_eligible == 0, float("-inf"))
    topk_ids = biased.topk(top_k, dim=-1).indices  # (tokens, top_k)
    topk_weights = scores.gather(1, topk_ids)
    if norm_topk_prob:
        # + 1e-20 as transformers and DeepSeek's own code write it: their weights to the bit
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_weights * routed_scaling_factor, topk_ids


def fused_moe(
    hidden: torch.Tensor,  # (tokens, hidden_size)
    w_gate_up: torch.Tensor,  # (num_experts, 2 * inter, hidden_size): each expert's gate rows, then its up rows
    w_down: torch.Tensor,  # (num_experts, hidden_size, inter)
    topk_weights: torch.Tensor,  # (tokens, top_k) float
    topk_ids: torch.Tensor,  # (tokens, top_k) int64 in [0, num_experts]
) -> torch.Tensor:
    """out[t] = sum_k topk_weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = topk_ids[t, k].

    An expert chosen twice by one token counts twice. The id `num_experts`, one past the last, marks
    a pair another expert rank holds (--ep: graphrt/model/moe.py): it adds nothing, whatever its
    weight, and the fast paths (the CPU's by-expert form, the Triton kernel) never run it; here it
    runs on the last expert at weight 0, as a static shape must. The weighted sum is taken in the wider of the
    hidden and weight dtypes (float32 for bfloat16 activations, float64 stays float64), then cast
    back to the hidden dtype.

    Which of two static-shape forms runs depends only on the shapes, so a graph captured for a
    bucket always replays the form its eager twin runs:
    - fewer (token, k) pairs than experts (decode at small buckets): gather the chosen experts'
      weights per pair and run them as batched matmuls. This reads only the experts some row chose,
      as the Triton kernel does; its cost grows with the pairs, so it stops paying at one pair per expert.
    - otherwise (prefill, large buckets): every expert on every row, multiplied by the row's weight
      for that expert, which is 0 where the row did not choose it. Each expert's weights are read
      once; a zero weight adds exactly 0.0 to the sum, whatever the expert computed there, so the
      result is the chosen experts' alone.
    Both are exact to rounding against a per-token loop (tests/model/test_moe.py).
    """
    num_tokens, top_k = topk_ids.shape
    num_experts = w_gate_up.shape[0]
    sum_dtype = torch.promote_types(hidden.dtype, topk_weights.dtype)
    elsewhere = topk_ids == num_experts  # another expert rank's pairs
    weights = torch.where(elsewhere, 0.0, topk_weights).to(sum_dtype)
    topk_ids = topk_ids.clamp(max=num_experts - 1)
    if num_tokens * top_k < num_experts:
        out = _chosen_experts_gathered(hidden, w_gate_up, w_down, weights, topk_ids)
    else:
        out = _every_expert_weighted(hidden, w_gate_up, w_down, weights, topk_ids)
    return out.to(hidden.dtype)


def _chosen_experts_gathered(hidden, w_gate_up, w_down, weights, topk_ids) -> torch.Tensor:
    num_tokens, top_k = topk_ids.shape
    pairs = topk_ids.reshape(-1)  # (tokens * top_k,): token t's k-th expert at t * top_k + k
    x = hidden.unsqueeze(1).expand(-1, top_k, -1).reshape(-1, hidden.shape[1], 1)  # (pairs, hidden_size, 1)
    gate_up = torch.bmm(w_gate_up.index_select(0, pairs), x).squeeze(-1)  # (pairs, 2 * inter)
    gate, up = gate_up.chunk(2, dim=-1)
    act = (F.silu(gate) * up).unsqueeze(-1)  # (pairs, inter, 1)
    down = torch.bmm(w_down.index_select(0, pairs), act).view(num_tokens, top_k, -1)  # (tokens, top_k, hidden_size)
    # where, as below: a pair of weight 0 (another expert rank's, under --ep) keeps nothing, even an overflow
    weights = weights.unsqueeze(-1)
    return torch.where(weights != 0, down.to(weights.dtype) * weights, 0.0).sum(dim=1)


def _every_expert_weighted(hidden, w_gate_up, w_down, weights, topk_ids) -> torch.Tensor:
    num_tokens, hidden_size = hidden.shape
    num_experts = w_gate_up.shape[0]
    # (tokens, num_experts): each row's weight for each expert, 0 where it chose none; scatter_add so
    # that an expert a row names twice gets both weights.
    per_expert = weights.new_zeros(num_tokens, num_experts).scatter_add_(1, topk_ids, weights)
    out = weights.new_zeros(num_tokens, hidden_size)
    for expert in range(num_experts):
        gate, up = F.linear(hidden, w_gate_up[expert]).chunk(2, dim=-1)
        down = F.linear(F.silu(gate) * up, w_down[expert])  # (tokens, hidden_size)
        weight = per_expert[:, expert : expert + 1]
        # where, not a product alone: an expert a row did not choose may overflow on it in half
        # precision, and 0 * inf is NaN.
        out += torch.where(weight != 0, weight * down.to(out.dtype), 0.0)
    return out
