"""RMSNorm with an optional fused residual add, matching HF Llama numerics (normalise in fp32, cast back)."""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from kestrel.layers.linear import _copy_checked


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """Without residual: norm(x). With residual: (norm(x + residual), x + residual)."""
    if residual is None:
        return _rms_norm(x, weight, eps)
    x = x + residual
    return _rms_norm(x, weight, eps), x


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, op: Callable[..., Any] = rms_norm_torch) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.weight.weight_loader = lambda p, t, name="?": _copy_checked(p, t, name)
        self.op = op   # rms_norm_torch, or its fused twin (kestrel/kernels/triton/fused_ops.py) on CUDA: layers/ops.py

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without residual: norm(x). With residual: (norm(x + residual), x + residual)."""
        return self.op(x, self.weight, self.eps, residual)
