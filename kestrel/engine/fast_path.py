"""Swap the model's torch ops for fused Triton kernels on CUDA (RMSNorm + residual, rotary, SiLU-mul).

The torch versions stay in place as the reference; KESTREL_DISABLE_FUSED_OPS=1 keeps them (for A/B runs).
KESTREL_FUSED_ATTN_PROLOGUE=1 (opt-in until measured on the GPU) also replaces each layer's q/k norm, rotary and
the backend's K/V write with one kernel (layers/attention_prologue.py), where the backend supports it.
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
    if backend is not None and os.environ.get("KESTREL_FUSED_ATTN_PROLOGUE") == "1":
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
