"""The mixture of experts on a CPU: each chosen expert once, on the rows that chose it.

The kernel sets' `fused_moe` (kernels/moe.py, kernels/moe_triton.py) keeps every shape static so
that a CUDA graph can hold it, which costs the torch reference either a copy of each chosen
expert's weights (few rows) or every expert on every row (many). A CPU stage replays no graph
(it runs the same code eagerly), so here the host may read the routing: the (token, k) pairs are
grouped by expert, and each expert that some row chose runs one pair of matmuls on its rows, as
transformers' experts loop does. Same definition, fewer bytes and FLOPs.

Each expert's matmul is an ordinary skinny one (a few rows at a decode step), so a CPU stage may keep
its experts one weight per expert (`ExpertWeights`) in the form its matmuls run fastest in (packed
for oneDNN, or in panels: kernels/cpu/linear.py), chosen by timing at load (kernels/cpu/stage_kernels.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from graphrt.kernels.cpu.linear import PANEL_WIDTH, linear, panel_linear_silu_and_mul, weight_form


class ExpertWeights(nn.ParameterList):
    """One sparse layer's routed experts of one projection kept one weight per expert, each in a
    form `linear` reads (packed for oneDNN, panels), read as the stacked tensor they replace is:
    experts[e] is expert e's weight, and `shape` (num_experts, out_features, in_features) and
    `dtype` are the stack's."""

    def __init__(self, weights: list[torch.Tensor], shape: torch.Size, dtype: torch.dtype):
        super().__init__(nn.Parameter(w, requires_grad=False) for w in weights)
        self.shape, self.dtype = torch.Size(shape), dtype

    @property
    def weights(self) -> list[torch.Tensor]:
        """Every expert's weight, as a compiled op takes them."""
        return list(self)

    @property
    def form(self) -> str:
        """The experts' weight form (dense, packed, panel), or "mixed"."""
        forms = {weight_form(w) for w in self}
        return forms.pop() if len(forms) == 1 else "mixed"


def fused_moe_by_expert(
    hidden: torch.Tensor,
    w_gate_up: torch.Tensor | ExpertWeights,
    w_down: torch.Tensor | ExpertWeights,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """kernels/moe.py's `fused_moe` (the same arguments, shapes and result, id num_experts included), summed in the same dtype
    (the wider of hidden's and the weights'); an expert a row names twice runs on that row twice.
    Experts kept one weight per expert in another form give the same result to that form's rounding.

    The rows are gathered once in expert order, each expert's matmuls read its slice (a gate/up
    weight in panels runs its SiLU-and-mul in the same pass), and one index_add_ sums the weighted
    results into their rows, expert by expert as a loop over the experts would. With every weight
    in panels the compiled `panel_experts` runs all the experts' matmuls (`in_panels`), bitwise as
    the loop does, with two parallel regions and no Python call per expert."""
    top_k = topk_ids.shape[1]
    sum_dtype = torch.promote_types(hidden.dtype, topk_weights.dtype)
    num_experts = w_gate_up.shape[0]
    # (tokens * top_k,): token t's k-th choice at t * top_k + k; a pair of weight 0, or another
    # expert rank's (id num_experts, under --ep), sorts past the last expert and is never run
    pairs = torch.where(topk_weights.reshape(-1) != 0, topk_ids.reshape(-1), num_experts)
    order = torch.argsort(pairs, stable=True)  # the pairs grouped by expert
    counts = torch.bincount(pairs, minlength=num_experts + 1)[:num_experts].tolist()  # the host reads the routing
    num_run = sum(counts)
    out = torch.zeros(hidden.shape, dtype=sum_dtype, device=hidden.device)
    if num_run == 0:
        return out.to(hidden.dtype)
    order = order[:num_run]
    rows_of = order // top_k
    gathered = hidden.index_select(0, rows_of)
    if in_panels(w_gate_up, w_down, hidden.dtype):
        downs = torch.ops.graphrt.panel_experts(gathered, counts, w_gate_up.weights, w_down.weights)
    else:
        downs = torch.cat(experts_one_by_one(gathered, counts, w_gate_up, w_down))
    weights = topk_weights.reshape(-1)[order].to(sum_dtype)
    out.index_add_(0, rows_of, downs.to(sum_dtype) * weights[:, None])
    return out.to(hidden.dtype)


def in_panels(w_gate_up, w_down, dtype: torch.dtype) -> bool:
    """Whether every expert's weights are in panels of `dtype`, each half of gate/up whole panels:
    then the compiled `panel_experts` runs them all, in two parallel regions in all."""
    return (
        isinstance(w_gate_up, ExpertWeights) and isinstance(w_down, ExpertWeights)
        and w_gate_up.form == w_down.form == "panel" and w_gate_up.dtype == w_down.dtype == dtype
        and w_gate_up.shape[1] % (2 * PANEL_WIDTH) == 0
    )


def experts_one_by_one(gathered: torch.Tensor, counts: list[int], w_gate_up, w_down) -> list[torch.Tensor]:
    """Each chosen expert's matmuls on its slice of `gathered` (rows in expert order), as a loop."""
    downs, start = [], 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue  # no row chose it: its weights are never read
        rows = gathered[start : start + count]
        downs.append(linear(gate_up_silu_and_mul(rows, w_gate_up[expert]), w_down[expert]))  # (count, hidden_size)
        start += count
    return downs


def gate_up_silu_and_mul(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up of one expert's gate/up matmul (gate columns first), for a weight in any form:
    in one pass for panels where each half is whole panels."""
    if weight_form(weight) == "panel" and weight.shape[0] % 2 == 0:
        return panel_linear_silu_and_mul(rows, weight)
    gate, up = linear(rows, weight).chunk(2, dim=-1)
    return F.silu(gate) * up
