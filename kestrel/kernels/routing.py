"""Routing: which k experts each token goes to, with what weight. The vocabulary between the MoE layers
(layers/moe.py computes it) and the kernels that sort tokens by expert (kernels/triton/moe_routing.py)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Routing:
    """Which k experts each token goes to and with what weight."""
    topk_ids: torch.Tensor       # [T, k] int64 expert ids
    topk_weights: torch.Tensor   # [T, k] float32
