"""LayerOps: the kernels a model's layers run, chosen once when the model is built.

A model passes these to its blocks at construction (RMSNorm, rotary, the MLP's SiLU-mul, each linear layer's
method, the attention prologue), so every architecture built from the same blocks gets the same fast path and
no code patches a model after it is built. `TORCH_OPS` is the reference (CPU, and the oracle on CUDA);
`choose_layer_ops` picks the fused Triton / CUDA kernels on CUDA:

    rms_norm        kestrel/kernels/triton/fused_ops.py   (add + RMSNorm in one kernel)
    apply_rotary    kestrel/kernels/triton/fused_ops.py
    silu_and_mul    kestrel/kernels/triton/fused_ops.py
    linear_method   layers/skinny.py      (decode-sized batches: Triton / CUDA C++ matmuls with the norm, SiLU-mul
                                           and attention prologue folded in; cuBLAS above)
    attn_prologue   kestrel/kernels/triton/attention_prologue.py (q/k norm + rotary + K/V write in one kernel), only with a
                                           backend that accepts K/V already in the cache
    fused_moe       layers/moe.py's fused_experts_torch; kestrel/kernels/triton/fused_moe.py on CUDA
                                           (unless KESTREL_FUSED_MOE=0)
    softmax_topk    layers/moe.py's softmax_topk (Qwen3-MoE / Mixtral routing); kestrel/kernels/triton/
                                           moe_routing.py (one launch instead of four) with the fused MoE
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

from kestrel.attention.base import AttentionBackend
from kestrel.envs import DevSwitches, switches
from kestrel.layers.linear import PLAIN, LinearMethod, silu_and_mul_torch
from kestrel.layers.moe import ExpertsImpl, Routing, fused_experts_torch, softmax_topk
from kestrel.layers.norm import rms_norm_torch
from kestrel.layers.rotary import apply_rotary_torch

logger = logging.getLogger("kestrel.ops")


@dataclass(frozen=True)
class LayerOps:
    rms_norm: Callable[..., object]        # (x, weight, eps, residual) -> y, or (y, x + residual) with residual
    apply_rotary: Callable[..., tuple[torch.Tensor, torch.Tensor]]   # (q, k, positions, cos_sin_cache)
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    linear_method: LinearMethod = PLAIN
    # (qkv, q_norm_w, k_norm_w, eps, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, heads, kv_heads,
    # head_dim) -> rotated q, k and v written to the caches; None: the backend writes K/V itself
    attn_prologue: Callable[..., torch.Tensor] | None = None
    # (x, w13, w2, topk_ids, topk_weights, silu_and_mul) -> the experts' weighted sum (layers/moe.py)
    fused_moe: ExpertsImpl = fused_experts_torch
    # (router logits [T, E], k, renormalize) -> Routing: softmax over the experts, the k largest
    softmax_topk: Callable[[torch.Tensor, int, bool], Routing] = softmax_topk


TORCH_OPS = LayerOps(rms_norm=rms_norm_torch, apply_rotary=apply_rotary_torch, silu_and_mul=silu_and_mul_torch)


def choose_layer_ops(device: torch.device, backend: AttentionBackend, dev: DevSwitches | None = None) -> LayerOps:
    """The fused kernels on CUDA (unless KESTREL_FUSED_OPS=0), the torch ops elsewhere."""
    dev = dev or switches()
    if device.type != "cuda" or not dev.fused_ops:
        return TORCH_OPS
    try:
        from kestrel.kernels.triton import fused_ops
    except ImportError as exc:   # no triton: keep the torch ops
        logger.warning("fused ops unavailable (%s); using torch ops", exc)
        return TORCH_OPS
    from kestrel.kernels.triton.attention_prologue import qk_norm_rope_store
    from kestrel.layers.skinny import skinny_method

    prologue = None
    if backend.supports_prewritten_kv():
        prologue = qk_norm_rope_store
    else:
        logger.warning("fused attention prologue not used: the %s backend writes K/V itself", backend.name)
    fused_moe: ExpertsImpl = fused_experts_torch
    route = softmax_topk
    if dev.fused_moe:
        from kestrel.kernels.triton.fused_moe import fused_experts_triton
        from kestrel.kernels.triton.moe_routing import softmax_topk_triton
        fused_moe, route = fused_experts_triton, softmax_topk_triton
    return LayerOps(rms_norm=fused_ops.rms_norm, apply_rotary=fused_ops.apply_rotary,
                    silu_and_mul=fused_ops.silu_and_mul,
                    linear_method=skinny_method(dev.skinny_matmul, dev.cuda_gemv) or PLAIN,
                    attn_prologue=prologue, fused_moe=fused_moe, softmax_topk=route)
