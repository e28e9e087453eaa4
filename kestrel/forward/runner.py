"""ModelRunner: owns the model, the paged KV cache and the attention backend; runs one ForwardBatch.

KV cache memory, one pair per layer (views into one allocation):

    kv_cache: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    layer l:  k_cache = kv_cache[l, 0], v_cache = kv_cache[l, 1]
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from kestrel.attention.base import AttentionBackend
from kestrel.forward.batch import ForwardBatch, ForwardOutput
from kestrel.models.model_config import ModelConfig

logger = logging.getLogger("kestrel.runner")


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * torch.finfo(dtype).bits // 8


class ModelRunner:
    def __init__(self, model: nn.Module, cfg: ModelConfig, backend: AttentionBackend, device: torch.device,
                 dtype: torch.dtype, block_size: int) -> None:
        self.model = model
        self.cfg = cfg
        self.backend = backend
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.kv_cache: torch.Tensor | None = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.graphs = None          # CudaGraphRunner for decode steps (the engine calls it directly)
        self.prefill_graphs = None  # PrefillGraphRunner for a lone sequence's prompt chunk

    def allocate_kv_cache(self, num_blocks: int) -> None:
        cfg = self.cfg
        # Zeroed: padded rows and masked positions read slots nobody wrote, and they must hold finite numbers.
        self.kv_cache = torch.zeros(cfg.num_layers, 2, num_blocks, self.block_size, cfg.num_kv_heads,
                                    cfg.head_dim, dtype=self.dtype, device=self.device)
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(cfg.num_layers)]

    def free_kv_cache(self) -> None:
        self.kv_cache = None
        self.kv_caches = []

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        """Run one step; `batch` may live on the CPU (it is moved) or already on the device."""
        if batch.input_ids.device != self.device:
            batch = batch.to(self.device)
        return self.forward_eager(batch)

    def forward_eager(self, batch: ForwardBatch, float_logits: bool = True) -> ForwardOutput:
        """float_logits=False leaves the logits in the model dtype (for a caller that casts them itself)."""
        self.backend.prepare(batch)
        hidden, captured = self.model(batch, self.backend, self.kv_caches)
        return ForwardOutput(logits=self.model.compute_logits(hidden, float_logits), hidden_states=captured)
