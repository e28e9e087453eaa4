"""SkinnyMatmuls: how a decode-sized batch (a few rows) runs a layer's matmuls, chosen once per weight shape.

At a handful of rows a matmul is a weight read; cuBLAS picks kernels that leave bandwidth unused on small
weights, and the norm / SiLU-mul before each matmul is a launch of its own. The Triton kernels of
layers/gemv.py read the weight once and fold those ops in:

    add + RMSNorm -> qkv_proj      add_rms_norm_gemv      (residual stream written by one program)
    o_proj                         gemv
    add + RMSNorm -> gate_up_proj  add_rms_norm_gemv
    SiLU-mul -> down_proj          silu_mul_gemv

`use_triton(rows, out_features, in_features)` says per batch size and weight shape whether that beats norm kernel + cuBLAS (measured
on the GPU, benchmarks/gemv_bench.py); where it does not, the unfused ops run, so the choice never changes
results beyond bf16 rounding order inside a dot product.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn


@dataclass(frozen=True)
class SkinnyMatmuls:
    max_rows: int                                   # batches with more rows take the usual path
    gemv: Callable[..., torch.Tensor]               # (x, w, bias) -> x @ w.T
    add_rms_norm_gemv: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    silu_mul_gemv: Callable[..., torch.Tensor]
    use_triton: Callable[[int, int, int], bool]

    def _triton(self, x: torch.Tensor, linear: nn.Module) -> bool:
        return self.use_triton(x.shape[0], *linear.weight.shape)

    def linear(self, x: torch.Tensor, linear: nn.Module) -> torch.Tensor:
        return self.gemv(x, linear.weight, linear.bias) if self._triton(x, linear) else linear(x)

    def norm_linear(self, x: torch.Tensor, residual: torch.Tensor | None, norm: nn.Module, linear: nn.Module
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(linear(norm(x + residual)), x + residual); residual None means x is the residual stream."""
        if self._triton(x, linear):
            return self.add_rms_norm_gemv(x, residual, norm.weight, norm.eps, linear.weight, linear.bias)
        if residual is None:
            return linear(norm(x)), x
        hidden, residual = norm(x, residual)
        return linear(hidden), residual

    def silu_linear(self, gate_up: torch.Tensor, linear: nn.Module, silu_and_mul: Callable | None = None
                    ) -> torch.Tensor:
        if self._triton(gate_up, linear):
            return self.silu_mul_gemv(gate_up, linear.weight, linear.bias)
        if silu_and_mul is not None:
            return linear(silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return linear(nn.functional.silu(gate) * up)
