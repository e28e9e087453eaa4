"""Swap the model's torch ops for fused Triton kernels on CUDA (RMSNorm + residual, rotary, SiLU-mul).

The torch versions stay in place as the reference; KESTREL_DISABLE_FUSED_OPS=1 keeps them (for A/B runs).
"""
from __future__ import annotations

import logging
import os

from torch import nn

logger = logging.getLogger("kestrel.fast_path")


def enable_fused_ops(model: nn.Module) -> bool:
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
    return True
