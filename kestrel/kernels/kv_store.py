"""Writing new tokens' K/V into the paged cache, in plain torch: the reference backend's write and the oracle of
the fused kernels that write as they go (kernels/triton/attention_prologue.py).

    k_cache, v_cache: [num_blocks, block_size, kv_heads, head_dim]; token slot s sits at block s // block_size,
    offset s % block_size, so a flat view [num_blocks * block_size, ...] indexes it by slot
"""
from __future__ import annotations

import torch


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write each new token's K/V at its flat slot; slot -1 (padding) is skipped."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[keep].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[keep].to(v_cache.dtype)


def store_kv_unpadded(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """store_kv for a slot_mapping with no padding: index_copy_ instead of boolean indexing, so no host sync and
    the write can be captured in a CUDA graph or compiled (benchmarks/fused_ops_bench.py times it that way)."""
    slots = slot_mapping.long()
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v.to(v_cache.dtype))
