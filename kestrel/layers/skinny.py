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

`cuda` (optional, layers/cuda_gemv.py) takes the weights its `use(x, weight, norm)` picks first: CUDA C++ kernels for
weights past the Triton kernels' range, the same folds, and SiLU-mul folded into gate_up's output instead of down's
input (`mlp`), so down_proj is a plain matmul there.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn


@dataclass(frozen=True)
class CudaSkinny:
    gemv: Callable[..., torch.Tensor]
    add_rms_norm_gemv: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    add_rms_norm_gemv_silu: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    use: Callable[[torch.Tensor, torch.Tensor, bool], bool]    # (x, weight, norm folded in) -> this kernel runs it
    # add + RMSNorm -> qkv_proj -> rotary, K/V write (a decode step's attention prologue, no q/k norm); None: off
    add_rms_norm_gemv_rope: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None


@dataclass(frozen=True)
class SkinnyMatmuls:
    max_rows: int                                   # batches with more rows take the usual path
    gemv: Callable[..., torch.Tensor]               # (x, w, bias) -> x @ w.T
    add_rms_norm_gemv: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    silu_mul_gemv: Callable[..., torch.Tensor]
    use_triton: Callable[[int, int, int], bool]
    cuda: CudaSkinny | None = None

    def _cuda(self, x: torch.Tensor, linear: nn.Module, norm: bool = False) -> bool:
        return self.cuda is not None and self.cuda.use(x, linear.weight, norm)

    def _triton(self, x: torch.Tensor, linear: nn.Module) -> bool:
        return self.use_triton(x.shape[0], *linear.weight.shape)

    def linear(self, x: torch.Tensor, linear: nn.Module) -> torch.Tensor:
        if self._cuda(x, linear):
            return self.cuda.gemv(x, linear.weight, linear.bias)
        return self.gemv(x, linear.weight, linear.bias) if self._triton(x, linear) else linear(x)

    def norm_linear(self, x: torch.Tensor, residual: torch.Tensor | None, norm: nn.Module, linear: nn.Module
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(linear(norm(x + residual)), x + residual); residual None means x is the residual stream."""
        if self._cuda(x, linear, norm=True):
            return self.cuda.add_rms_norm_gemv(x, residual, norm.weight, norm.eps, linear.weight, linear.bias)
        if self._triton(x, linear):
            return self.add_rms_norm_gemv(x, residual, norm.weight, norm.eps, linear.weight, linear.bias)
        if residual is None:
            return linear(norm(x)), x
        hidden, residual = norm(x, residual)
        return linear(hidden), residual

    def norm_linear_rope(self, x: torch.Tensor, residual: torch.Tensor | None, norm: nn.Module, linear: nn.Module,
                         **prologue) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rotated q, x + residual) with k and v written to the caches: the QKV projection with the attention
        prologue folded in (`prologue`: positions, cos_sin_cache, k_cache, v_cache, slot_mapping, num_heads,
        num_kv_heads, head_dim); None where that kernel does not serve (the caller runs norm_linear and the
        prologue)."""
        cuda = self.cuda
        if cuda is None or cuda.add_rms_norm_gemv_rope is None or not self._cuda(x, linear, norm=True):
            return None
        return cuda.add_rms_norm_gemv_rope(x, residual, norm.weight, norm.eps, linear.weight, linear.bias,
                                           **prologue)

    def mlp(self, x: torch.Tensor, residual: torch.Tensor | None, norm: nn.Module, gate_up: nn.Module,
            down: nn.Module, silu_and_mul: Callable | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(down(silu_mul(gate_up(norm(x + residual)))), x + residual)."""
        if self._cuda(x, gate_up, norm=True):
            act, residual = self.cuda.add_rms_norm_gemv_silu(x, residual, norm.weight, norm.eps, gate_up.weight,
                                                             gate_up.bias)
            return self.linear(act, down), residual
        hidden, residual = self.norm_linear(x, residual, norm, gate_up)
        return self.silu_linear(hidden, down, silu_and_mul), residual

    def silu_linear(self, gate_up: torch.Tensor, linear: nn.Module, silu_and_mul: Callable | None = None
                    ) -> torch.Tensor:
        if self._triton(gate_up, linear):
            return self.silu_mul_gemv(gate_up, linear.weight, linear.bias)
        if silu_and_mul is not None:
            return linear(silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return linear(nn.functional.silu(gate) * up)
