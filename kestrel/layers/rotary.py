"""Rotary position embedding (NeoX / HF "rotate_half" layout) with Llama-3 frequency scaling."""
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
        if scaling is not None:
            inv_freq = llama3_inv_freq(inv_freq, scaling)
        t = torch.arange(max_position, dtype=torch.int64).float()
        freqs = torch.outer(t, inv_freq)                      # [max_pos, head_dim / 2]
        # cos_sin_cache: [max_pos, head_dim]: cos in the first half, sin in the second
        self.register_buffer("cos_sin_cache", torch.cat([freqs.cos(), freqs.sin()], dim=-1), persistent=False)
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
