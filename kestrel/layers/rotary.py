"""Rotary position embedding (NeoX / HF "rotate_half" layout) with Llama-3 or YaRN frequency scaling."""
from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import nn


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama-3's piecewise rescaling: long wavelengths slowed by `factor`, short kept, a smooth ramp between."""
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_inv_freq(head_dim: int, base: float, scaling: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN: (inv_freq, attention_factor). High-frequency dims (many turns over the original context) keep their
    frequency, low-frequency ones are slowed by `factor`, a linear ramp between the dims that turn beta_fast and
    beta_slow times; cos and sin are multiplied by attention_factor."""
    factor = float(scaling["factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim) \
            if mscale and mscale_all_dim else yarn_mscale(factor)
    beta_fast, beta_slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def dim_turning(turns: float) -> float:   # the dim whose wavelength fits `turns` times in the old context
        return head_dim * math.log(old_len / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_turning(beta_fast), dim_turning(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    keep = 1 - ramp    # 1: the dim keeps its frequency
    return extrapolation / factor * (1 - keep) + extrapolation * keep, float(attention_factor)


def apply_rotary_torch(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, Hq, D], k: [T, Hkv, D] -> rotated copies."""
    cos, sin = cos_sin_cache[positions].to(q.dtype).unsqueeze(1).chunk(2, dim=-1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float, scaling: dict[str, Any] | None,
                 op: Callable[..., tuple[torch.Tensor, torch.Tensor]] = apply_rotary_torch) -> None:
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        attention_factor = 1.0
        kind = scaling.get("rope_type", scaling.get("type")) if scaling is not None else None
        if kind == "yarn":
            inv_freq, attention_factor = yarn_inv_freq(head_dim, base, scaling)
        elif scaling is not None:
            inv_freq = llama3_inv_freq(inv_freq, scaling)
        t = torch.arange(max_position, dtype=torch.int64).float()
        freqs = torch.outer(t, inv_freq)                      # [max_pos, head_dim / 2]
        # cos_sin_cache: [max_pos, head_dim]: cos in the first half, sin in the second (YaRN: both scaled)
        table = torch.cat([freqs.cos() * attention_factor, freqs.sin() * attention_factor], dim=-1)
        self.register_buffer("cos_sin_cache", table, persistent=False)
        self.op = op   # apply_rotary_torch, or its fused twin (kestrel/kernels/triton/fused_ops.py) on CUDA: layers/ops.py

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, Hq, D], k: [T, Hkv, D] -> rotated copies."""
        return self.op(q, k, positions, self.cos_sin_cache)


class PartialRotaryEmbedding(RotaryEmbedding):
    """Rotary on the first rotary_dim dims of each head (HF's partial_rotary_factor); the rest pass through.

        head: [ rotated (rotary_dim, halves layout) | unrotated (head_dim - rotary_dim) ]
    cos_sin_cache is rotary_dim wide, so a fused prologue that assumes a full-width table must not be used with it
    (models/glm4_moe.py builds its attention without one)."""

    def __init__(self, rotary_dim: int, max_position: int, base: float, scaling: dict[str, Any] | None,
                 op: Callable[..., tuple[torch.Tensor, torch.Tensor]] = apply_rotary_torch) -> None:
        super().__init__(rotary_dim, max_position, base, scaling, op)
        self.rotary_dim = rotary_dim

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        d = self.rotary_dim
        q_rot, k_rot = self.op(q[..., :d].contiguous(), k[..., :d].contiguous(), positions, self.cos_sin_cache)
        return torch.cat([q_rot, q[..., d:]], dim=-1), torch.cat([k_rot, k[..., d:]], dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    cos = torch.cat([cos, cos], dim=-1)
    sin = torch.cat([sin, sin], dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin
