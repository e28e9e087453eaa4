"""Swap the model's torch ops for fused Triton kernels on CUDA (RMSNorm + residual, rotary, SiLU-mul).

The torch versions stay in place as the reference; KESTREL_DISABLE_FUSED_OPS=1 keeps them (for A/B runs).
Each layer's q/k norm, rotary and the backend's K/V write also become one kernel (layers/attention_prologue.py)
where the backend supports it (measured on the H200: bs1 decode step -3.7% on the Qwen3-0.6B shape, -1% on the
Llama-3.1-8B shape); KESTREL_FUSED_ATTN_PROLOGUE=0 turns that off.
Decode-sized batches (<= 16 rows) run each layer's matmuls through layers/skinny.py: Triton kernels that fold the
norms and SiLU-mul in, for the weight shapes where they beat cuBLAS (`skinny_policy`); KESTREL_SKINNY_MATMUL=0
turns that off, =all sends every shape to Triton (for A/B runs). Weights past the Triton range go to the CUDA C++
kernels of layers/cuda_gemv.py where KESTREL_CUDA_GEMV (`cuda_skinny`) lets them.
"""
from __future__ import annotations

import logging
import os
from typing import Callable

from torch import nn

from kestrel.attention.base import AttentionBackend

logger = logging.getLogger("kestrel.fast_path")


def enable_fused_ops(model: nn.Module, backend: AttentionBackend | None = None) -> bool:
    if os.environ.get("KESTREL_DISABLE_FUSED_OPS") == "1":
        return False
    try:
        from kestrel.layers import fused_ops
    except ImportError as exc:   # no triton: keep the torch ops
        logger.warning("fused ops unavailable (%s); using torch ops", exc)
        return False
    from kestrel.layers.norm import RMSNorm
    from kestrel.models.llama import MLP

    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.fused = fused_ops.rms_norm
        elif isinstance(module, MLP):
            module.silu_and_mul = fused_ops.silu_and_mul
    model.rotary.fused = fused_ops.apply_rotary
    skinny = skinny_matmuls(os.environ.get("KESTREL_SKINNY_MATMUL", "auto"))
    if skinny is not None:
        from kestrel.models.llama import DecoderLayer
        for module in model.modules():
            if isinstance(module, DecoderLayer):
                module.skinny = skinny
    if backend is not None and os.environ.get("KESTREL_FUSED_ATTN_PROLOGUE", "1") != "0":
        from kestrel.layers.attention_prologue import qk_norm_rope_store
        enable_fused_attn_prologue(model, backend, qk_norm_rope_store)
    return True


def enable_fused_attn_prologue(model: nn.Module, backend: AttentionBackend, prologue: Callable) -> bool:
    """Make every Attention layer call `prologue` (qk_norm_rope_store or its _ref) and hand the backend
    k = v = None; refused (False, nothing changed) when the backend writes K/V itself."""
    if not backend.supports_prewritten_kv():
        logger.warning("fused attention prologue not used: the %s backend writes K/V itself",
                       getattr(backend, "name", type(backend).__name__))
        return False
    from kestrel.models.llama import Attention

    for module in model.modules():
        if isinstance(module, Attention):
            module.prologue = prologue
    logger.info("fused attention prologue on (q/k norm + rotary + K/V write in one kernel)")
    return True


# Measured on the H200 (benchmarks/gemv_bench.py, inside CUDA graphs, weights read from HBM), Triton vs cuBLAS:
#   Qwen3-0.6B shapes, 1 row: qkv 4.2 vs 4.9 us, o 3.3 vs 12.7, gate_up 5.3 vs 5.9, down 4.5 vs 6.7 (and the
#   norm / SiLU kernels folded in); 4 rows: only the split-K shapes (out < in: o 4.7 vs 8.3, down 6.5 vs 6.7) win.
#   Llama-3.1-8B shapes: even at 1 row within 5% of cuBLAS (~4 TB/s), and the whole bs1 step got slower
#   (4.49 -> 4.60 ms), so weights above SKINNY_MAX_WEIGHT_BYTES leave Triton: for the CUDA C++ kernels
#   (cuda_skinny; session 12: 8B bs1 step -9.8% / -11.0% against cuBLAS) or cuBLAS.
SKINNY_MAX_WEIGHT_BYTES = 16 << 20


def skinny_policy(rows: int, out_features: int, in_features: int, element_size: int = 2,
                  max_weight_bytes: int = SKINNY_MAX_WEIGHT_BYTES) -> bool:
    if out_features * in_features * element_size > max_weight_bytes:
        return False
    return rows <= 2 or (rows <= 4 and out_features < in_features)


def skinny_weight_cap() -> int:
    """SKINNY_MAX_WEIGHT_BYTES, or KESTREL_SKINNY_MAX_MB (A/B: 64 puts the 8B's qkv and o_proj, 48 and 32 MB, on
    the Triton path with their norm folded in and no split-K reduce; measured before PDL, 4.49 -> 4.60 ms)."""
    mb = os.environ.get("KESTREL_SKINNY_MAX_MB")
    return int(mb) << 20 if mb else SKINNY_MAX_WEIGHT_BYTES


def skinny_matmuls(mode: str = "auto"):
    """The SkinnyMatmuls the decoder layers use on CUDA (None: keep the plain path)."""
    if mode == "0":
        return None
    from kestrel.layers import gemv
    from kestrel.layers.skinny import SkinnyMatmuls

    cap = skinny_weight_cap()
    policy = (lambda rows, n, k: True) if mode == "all" else \
        (lambda rows, n, k: skinny_policy(rows, n, k, max_weight_bytes=cap))
    return SkinnyMatmuls(max_rows=gemv.MAX_M, gemv=gemv.gemv, add_rms_norm_gemv=gemv.add_rms_norm_gemv,
                         silu_mul_gemv=gemv.silu_mul_gemv, use_triton=policy,
                         cuda=cuda_skinny(os.environ.get("KESTREL_CUDA_GEMV", "auto"), cap))


def cuda_skinny(mode: str, triton_cap: int):
    """The CUDA C++ skinny matmuls (layers/cuda_gemv.py) for weights above the Triton kernels' cap (`auto`, the
    default: the Llama-3.1-8B's four matmuls, bs1 step -9.8% on the H200), every weight they can serve (`all`), or
    none (`0`); at one row, or up to KESTREL_CUDA_GEMV_MAX_ROWS (at 4 rows cuBLAS was as fast or faster on the 8B's
    shapes, benchmarks/cuda_gemv_bench.py). KESTREL_CUDA_GEMV_MAX_MB caps the weights they take (A/B: 50 keeps the
    8B's gate_up and down on cuBLAS)."""
    if mode == "0":
        return None
    if mode not in ("auto", "all"):
        raise ValueError(f"KESTREL_CUDA_GEMV={mode}: use 0, auto or all")
    from kestrel.layers import cuda_gemv
    from kestrel.layers.skinny import CudaSkinny

    low = 0 if mode == "all" else triton_cap
    mb = os.environ.get("KESTREL_CUDA_GEMV_MAX_MB")
    high = int(mb) << 20 if mb else 1 << 62
    max_rows = int(os.environ.get("KESTREL_CUDA_GEMV_MAX_ROWS", "1"))

    def use(x, weight, norm: bool) -> bool:
        return (x.shape[0] <= max_rows and low < weight.numel() * weight.element_size() <= high
                and cuda_gemv.usable(x, weight, norm))

    rope = os.environ.get("KESTREL_CUDA_GEMV_ROPE", "1") == "1"   # the attention prologue folded into qkv
    return CudaSkinny(gemv=cuda_gemv.gemv, add_rms_norm_gemv=cuda_gemv.add_rms_norm_gemv,
                      add_rms_norm_gemv_silu=cuda_gemv.add_rms_norm_gemv_silu, use=use,
                      add_rms_norm_gemv_rope=cuda_gemv.add_rms_norm_gemv_rope if rope else None)
