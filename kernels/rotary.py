"""Rotary position embedding (neox layout: the two halves of head_dim rotate together).

Frequencies as transformers computes them for rope_type default, linear, llama3 and yarn (YaRN:
frequencies blended between interpolated and extrapolated by wavelength, cos and sin scaled by its
attention factor; DeepSeek-V3 and Kimi K2 also scale the softmax, see `yarn_softmax_mscale`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"  # default | linear | llama3 | yarn
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position: int = 8192  # llama3, yarn
    beta_fast: float = 32.0  # yarn: the ramp between extrapolated and interpolated frequencies
    beta_slow: float = 1.0
    truncate: bool = True
    mscale: float | None = None  # yarn: with mscale_all_dim, they set the attention factor when it is not given
    mscale_all_dim: float | None = None
    attention_factor: float | None = None

    def yarn_attention_factor(self) -> float:
        """What yarn multiplies cos and sin by (so each rotary score by its square)."""
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    def yarn_softmax_mscale(self) -> float:
        """What an MLA model multiplies its softmax scale by: mscale(factor, mscale_all_dim) squared
        under yarn, so the scores of all dimensions, not only the rotary ones (DeepSeek's rule)."""
        if self.rope_type == "default" or not self.mscale_all_dim:
            return 1.0
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context stretched by `factor` (its Eq. 21)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inv_freq(rope: RopeConfig, head_dim: int, pos_freqs: torch.Tensor) -> torch.Tensor:
    """Frequencies that turn fewer than beta_slow times over the original context are interpolated
    (divided by factor), those that turn more than beta_fast times kept, the band between blended."""

    def dim_turning(turns: float) -> float:  # the dimension whose frequency turns `turns` times
        return head_dim * math.log(rope.original_max_position / (turns * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = dim_turning(rope.beta_fast), dim_turning(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp
    return (1.0 / (rope.factor * pos_freqs)) * (1 - kept) + (1.0 / pos_freqs) * kept


def _inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    pos_freqs = rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    if rope.rope_type == "yarn":
        return _yarn_inv_freq(rope, head_dim, pos_freqs)
    inv_freq = 1.0 / pos_freqs
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
        low_wavelen = rope.original_max_position / rope.low_freq_factor
        high_wavelen = rope.original_max_position / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
        in_band = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(in_band, blended, scaled)
    return inv_freq


def rotary_cos_sin(rope: RopeConfig, head_dim: int, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tables of shape (max_position, head_dim) in float32, indexed by position at run time."""
    inv_freq = _inv_freq(rope, head_dim)
    positions = torch.arange(max_position, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)  # (max_position, head_dim / 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    if rope.rope_type == "yarn":
        scale = rope.yarn_attention_factor()
        return emb.cos() * scale, emb.sin() * scale
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: (tokens, heads, head_dim), k: (tokens, kv_heads, head_dim), cos/sin: (tokens, head_dim)."""
    cos = cos.unsqueeze(1).to(q.dtype)
    sin = sin.unsqueeze(1).to(q.dtype)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
