"""SkinnyLinearMethod: how a decode-sized batch (a few rows) runs a linear layer, chosen per weight shape.

At a handful of rows a matmul is a weight read; cuBLAS picks kernels that leave bandwidth unused on small
weights, and the norm / SiLU-mul before each matmul is a launch of its own. The Triton kernels of
kestrel/kernels/triton/gemv.py read the weight once and fold those ops in:

    add + RMSNorm -> qkv_proj      add_rms_norm_gemv      (residual stream written by one program)
    o_proj                         gemv
    add + RMSNorm -> gate_up_proj  add_rms_norm_gemv
    SiLU-mul -> down_proj          silu_mul_gemv

`use_triton(rows, out_features, in_features)` says per batch size and weight shape whether that beats norm kernel
+ cuBLAS (`skinny_policy`, measured on the H200); where it does not, the plain method runs, so the choice never
changes results beyond bf16 rounding order inside a dot product.

`cuda` (optional, kestrel/kernels/cuda/cuda_gemv.py) takes the weights its `use(x, weight, norm)` picks first: CUDA C++ kernels
for weights past the Triton kernels' range, the same folds, SiLU-mul folded into gate_up's output instead of
down's input, and the attention prologue (rotary, K/V write) folded into qkv's output.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from kestrel.layers.linear import LinearBase, LinearMethod, Norm, RopeInputs

# Triton vs cuBLAS inside CUDA graphs, weights read from HBM (H200): on the Qwen3-0.6B's shapes at 1 row Triton
# wins every matmul (o_proj 3.3 vs 12.7 us), at 4 rows only where out < in (split-K); on the Llama-3.1-8B's shapes
# it is within 5% of cuBLAS and the whole step got slower, so weights above this size leave Triton (for the CUDA
# C++ kernels, or cuBLAS).
SKINNY_MAX_WEIGHT_BYTES = 16 << 20
CUDA_GEMV_MAX_ROWS = 1   # at 2-4 rows cuBLAS was as fast on the 8B's shapes
FOLD_ROPE = True         # the attention prologue folded into the CUDA QKV kernel (-0.8% on the 8B bs1 step)


def skinny_policy(rows: int, out_features: int, in_features: int, element_size: int = 2,
                  max_weight_bytes: int = SKINNY_MAX_WEIGHT_BYTES) -> bool:
    """Whether the Triton skinny kernel beats cuBLAS for this batch size and weight shape."""
    if out_features * in_features * element_size > max_weight_bytes:
        return False
    return rows <= 2 or (rows <= 4 and out_features < in_features)


@dataclass(frozen=True)
class CudaSkinny:
    gemv: Callable[..., torch.Tensor]
    add_rms_norm_gemv: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    add_rms_norm_gemv_silu: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    use: Callable[[torch.Tensor, torch.Tensor, bool], bool]    # (x, weight, norm folded in) -> this kernel runs it
    # add + RMSNorm -> qkv_proj -> rotary, K/V write (a decode step's attention prologue, no q/k norm); None: off
    add_rms_norm_gemv_rope: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None


@dataclass(frozen=True)
class SkinnyLinearMethod(LinearMethod):
    max_rows: int                                   # batches with more rows take the plain method
    gemv: Callable[..., torch.Tensor]               # (x, w, bias) -> x @ w.T
    add_rms_norm_gemv: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    silu_mul_gemv: Callable[..., torch.Tensor]
    use_triton: Callable[[int, int, int], bool]
    cuda: CudaSkinny | None = None

    def _cuda(self, x: torch.Tensor, layer: LinearBase, norm: bool = False) -> bool:
        return self.cuda is not None and x.shape[0] <= self.max_rows and self.cuda.use(x, layer.weight, norm)

    def _triton(self, x: torch.Tensor, layer: LinearBase) -> bool:
        return x.shape[0] <= self.max_rows and self.use_triton(x.shape[0], *layer.weight.shape)

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        if self._cuda(x, layer):
            return self.cuda.gemv(x, layer.weight, layer.bias)
        if self._triton(x, layer):
            return self.gemv(x, layer.weight, layer.bias)
        return super().apply(layer, x)

    def apply_norm(self, layer: LinearBase, x: torch.Tensor, residual: torch.Tensor | None, norm: Norm
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cuda(x, layer, norm=True):
            return self.cuda.add_rms_norm_gemv(x, residual, norm.weight, norm.eps, layer.weight, layer.bias)
        if self._triton(x, layer):
            return self.add_rms_norm_gemv(x, residual, norm.weight, norm.eps, layer.weight, layer.bias)
        return super().apply_norm(layer, x, residual, norm)

    def apply_norm_silu(self, layer: LinearBase, x: torch.Tensor, residual: torch.Tensor | None, norm: Norm,
                        silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
                        ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        if self._cuda(x, layer, norm=True):
            act, residual = self.cuda.add_rms_norm_gemv_silu(x, residual, norm.weight, norm.eps, layer.weight,
                                                             layer.bias)
            return act, residual, True
        return super().apply_norm_silu(layer, x, residual, norm, silu_and_mul)

    def apply_silu(self, layer: LinearBase, gate_up: torch.Tensor,
                   silu_and_mul: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        if self._triton(gate_up, layer):
            return self.silu_mul_gemv(gate_up, layer.weight, layer.bias)
        return super().apply_silu(layer, gate_up, silu_and_mul)

    def apply_norm_rope(self, layer: LinearBase, x: torch.Tensor, residual: torch.Tensor | None, norm: Norm,
                        rope: RopeInputs) -> tuple[torch.Tensor, torch.Tensor] | None:
        cuda = self.cuda
        if cuda is None or cuda.add_rms_norm_gemv_rope is None or not self._cuda(x, layer, norm=True):
            return None
        if rope.k_cache.dtype != x.dtype:   # an FP8 cache: the CUDA fold writes the model dtype only
            return None
        return cuda.add_rms_norm_gemv_rope(
            x, residual, norm.weight, norm.eps, layer.weight, layer.bias, positions=rope.positions,
            cos_sin_cache=rope.cos_sin_cache, k_cache=rope.k_cache, v_cache=rope.v_cache,
            slot_mapping=rope.slot_mapping, num_heads=rope.num_heads, num_kv_heads=rope.num_kv_heads,
            head_dim=rope.head_dim)


def skinny_method(mode: str = "auto", cuda_mode: str = "auto") -> SkinnyLinearMethod | None:
    """The decode-sized method on CUDA: Triton kernels where `skinny_policy` says they win (`mode` auto), for
    every weight (all), or none (0); the CUDA C++ kernels for the weights past the Triton range (`cuda_mode`)."""
    if mode == "0":
        return None
    from kestrel.kernels.triton import gemv

    policy = (lambda rows, n, k: True) if mode == "all" else skinny_policy
    return SkinnyLinearMethod(max_rows=gemv.MAX_M, gemv=gemv.gemv, add_rms_norm_gemv=gemv.add_rms_norm_gemv,
                              silu_mul_gemv=gemv.silu_mul_gemv, use_triton=policy, cuda=cuda_skinny(cuda_mode))


def cuda_skinny(mode: str) -> CudaSkinny | None:
    """The CUDA C++ one-row matmuls (kestrel/kernels/cuda/cuda_gemv.py) for weights above the Triton kernels' cap (`auto`: the
    Llama-3.1-8B's four matmuls), every weight they can serve (`all`), or none (`0`)."""
    if mode == "0":
        return None
    if mode not in ("auto", "all"):
        raise ValueError(f"KESTREL_CUDA_GEMV={mode}: use 0, auto or all")
    from kestrel.kernels.cuda import cuda_gemv

    low = 0 if mode == "all" else SKINNY_MAX_WEIGHT_BYTES

    def use(x: torch.Tensor, weight: torch.Tensor, norm: bool) -> bool:
        return (x.shape[0] <= CUDA_GEMV_MAX_ROWS and weight.numel() * weight.element_size() > low
                and cuda_gemv.usable(x, weight, norm))

    return CudaSkinny(gemv=cuda_gemv.gemv, add_rms_norm_gemv=cuda_gemv.add_rms_norm_gemv,
                      add_rms_norm_gemv_silu=cuda_gemv.add_rms_norm_gemv_silu, use=use,
                      add_rms_norm_gemv_rope=cuda_gemv.add_rms_norm_gemv_rope if FOLD_ROPE else None)
