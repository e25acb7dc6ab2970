"""SiLU-and-mul for the gated MLP."""

import torch
import torch.nn.functional as F


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """(tokens, 2 * inter) -> (tokens, inter): silu(gate) * up, gate first as in the fused weight."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gate_up_silu(x: torch.Tensor, gate_up_weight: torch.Tensor) -> torch.Tensor:
    """The gated MLP's first half: silu_and_mul of the fused gate/up matmul."""
    return silu_and_mul(F.linear(x, gate_up_weight))
