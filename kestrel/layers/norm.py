"""RMSNorm with an optional fused residual add, matching HF Llama numerics (normalise in fp32, cast back)."""
from __future__ import annotations

import torch
from torch import nn

from kestrel.layers.linear import _copy_checked


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.weight.weight_loader = lambda p, t, name="?": _copy_checked(p, t, name)
        self.fused = None   # set by the runner on CUDA: a Triton rms_norm(x, w, eps, residual) kernel

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without residual: norm(x). With residual: (norm(x + residual), x + residual)."""
        if self.fused is not None:
            return self.fused(x, self.weight, self.eps, residual)
        if residual is None:
            return rms_norm_torch(x, self.weight, self.eps)
        x = x + residual
        return rms_norm_torch(x, self.weight, self.eps), x
