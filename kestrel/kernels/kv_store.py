"""Writing new tokens' K/V into the paged cache, in plain torch: the reference backend's write and the oracle of
the fused kernels that write as they go (kernels/triton/attention_prologue.py).

    k_cache, v_cache: [num_blocks, block_size, kv_heads, head_dim]; token slot s sits at block s // block_size,
    offset s % block_size, so a flat view [num_blocks * block_size, ...] indexes it by slot

An FP8 cache (--kv-cache-dtype fp8: float8_e4m3fn, one byte an element) holds x / scale rounded to e4m3 and
clamped to its range (+-448); readers multiply by the same scale. One scale a tensor: each layer's K and V have
their own (k_scale, v_scale: the checkpoint's, else 1.0). A cache of the model dtype ignores the scales: the
value is stored as it is, so a model's scales mean nothing unless the cache is FP8.
"""
from __future__ import annotations

import torch

from kestrel.kernels.fp8_quant import FP8 as FP8_KV_DTYPE, FP8_MAX as FP8_KV_MAX   # e4m3, 448: the weights' FP8


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8_KV_DTYPE


def effective_scales(cache: torch.Tensor, k_scale: float, v_scale: float) -> tuple[float, float]:
    """The scales a write or read applies to `cache`: the layer's for an FP8 cache, 1.0 for any other."""
    return (k_scale, v_scale) if is_fp8(cache) else (1.0, 1.0)


def quantize(x: torch.Tensor, cache: torch.Tensor, scale: float) -> torch.Tensor:
    """x in cache's dtype: x / scale clamped into e4m3's range for an FP8 cache, a plain cast otherwise."""
    if not is_fp8(cache):
        return x.to(cache.dtype)
    return (x.float() / scale).clamp(-FP8_KV_MAX, FP8_KV_MAX).to(FP8_KV_DTYPE)


def dequantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Cached values (any cache dtype) back as `dtype`: times scale for FP8, a plain cast otherwise."""
    if not is_fp8(x):
        return x.to(dtype)
    return (x.float() * scale).to(dtype)


def _rows(cache: torch.Tensor) -> torch.Tensor:
    """[slots, ...] view of a cache; bytes for FP8, since torch's index_put / index_copy have no FP8 kernels on
    every device."""
    flat = cache.view(-1, *cache.shape[2:])
    return flat.view(torch.uint8) if is_fp8(cache) else flat


def _as_rows(x: torch.Tensor, cache: torch.Tensor, scale: float) -> torch.Tensor:
    q = quantize(x, cache, scale)
    return q.view(torch.uint8) if is_fp8(cache) else q


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Write each new token's K/V at its flat slot; slot -1 (padding) is skipped."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    _rows(k_cache)[slots] = _as_rows(k[keep], k_cache, k_scale)
    _rows(v_cache)[slots] = _as_rows(v[keep], v_cache, v_scale)


def store_kv_unpadded(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """store_kv for a slot_mapping with no padding: index_copy_ instead of boolean indexing, so no host sync and
    the write can be captured in a CUDA graph or compiled (benchmarks/fused_ops_bench.py times it that way)."""
    slots = slot_mapping.long()
    _rows(k_cache).index_copy_(0, slots, _as_rows(k, k_cache, k_scale))
    _rows(v_cache).index_copy_(0, slots, _as_rows(v, v_cache, v_scale))
