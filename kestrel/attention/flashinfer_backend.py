"""FlashInferAttentionBackend: optional, used only when asked for and `import flashinfer` works.

FlashInfer's paged layout "NHD" is ours: k_cache, v_cache [num_pages, page_size, num_kv_heads, head_dim], passed
as a (k, v) tuple. A sequence's pages are described CSR-style instead of by a padded block table:
    indices[indptr[s] : indptr[s + 1]]  its pages in order,   last_page_len[s]  tokens used in its last page
Its causal mask aligns queries to the end of the context (query i of s at kv_len - q_len + i), as ours does.
Planning copies the page metadata to the host, so this backend does not support CUDA graphs.
"""
from __future__ import annotations

import torch

from kestrel.kernels.triton import paged_attention
from kestrel.attention.base import AttentionBackend
from kestrel.batch import ForwardBatch
from kestrel.errors import KestrelError

WORKSPACE_BYTES = 128 * 1024 * 1024
# Head sizes FlashInfer 0.5 runs correctly. Its FA3 prefill (picked on Hopper) fails a static assertion in nvcc for
# others (head_dim 16 on the H200), and its FA2 prefill faults or silently computes wrong results for
# sizes not a multiple of 64 (flashinfer-ai/flashinfer#4299): refuse them with a clear error instead.
SUPPORTED_HEAD_DIMS = (64, 128, 256)


def _import_flashinfer():
    try:
        import flashinfer
    except Exception as exc:  # noqa: BLE001 - any import failure means the optional dependency is unusable
        raise KestrelError(f"attention backend 'flashinfer' needs the 'flashinfer-python' package, which failed "
                           f"to import ({exc}); install it or choose --attention-backend triton") from exc
    return flashinfer


def check_kv_cache_dtype(kv_dtype: torch.dtype) -> None:
    """Kestrel hands FlashInfer no KV scales: an FP8 cache is refused rather than read unscaled."""
    if kv_dtype.itemsize == 1:
        raise KestrelError("attention backend 'flashinfer' does not support --kv-cache-dtype fp8 in Kestrel; "
                           "choose --attention-backend triton (or torch), or --kv-cache-dtype auto")


def check_head_dim(head_dim: int) -> None:
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise KestrelError(f"attention backend 'flashinfer' supports head_dim {SUPPORTED_HEAD_DIMS}, this model has "
                           f"{head_dim}; choose --attention-backend triton")


class FlashInferAttentionBackend(AttentionBackend):
    name = "flashinfer"
    compiles_at_first_use = True   # nvcc builds its prefill/decode modules on a fresh machine (minutes)

    def __init__(self) -> None:
        self._flashinfer = _import_flashinfer()
        self._workspace: torch.Tensor | None = None
        self._decode = None
        self._prefill = None
        self._planned_for: ForwardBatch | None = None

    def prepare(self, batch: ForwardBatch) -> None:
        self._planned_for = None   # plan again at the first layer of this step

    def forward(self, q, k, v, k_cache, v_cache, batch: ForwardBatch, scale: float, k_scale: float = 1.0,
                v_scale: float = 1.0) -> torch.Tensor:
        check_kv_cache_dtype(k_cache.dtype)   # startup refuses it first (forward/startup.py)
        paged_attention.store_kv(k, v, k_cache, v_cache, batch.slot_mapping)
        if self._planned_for is not batch:   # every layer of a step shares one plan
            assert batch.tree_mask is None, "flashinfer does not support tree masks (supports_tree_mask is False)"
            self._plan(batch, q, k_cache, scale)
            self._planned_for = batch            # a strong reference, so the identity test cannot be fooled
        wrapper = self._decode if batch.is_decode else self._prefill
        return wrapper.run(q.contiguous(), (k_cache, v_cache))

    @torch.inference_mode()   # the wrappers' buffers are made and refilled under it, whoever calls forward
    def _plan(self, batch: ForwardBatch, q: torch.Tensor, k_cache: torch.Tensor, scale: float) -> None:
        device = q.device
        page_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
        check_head_dim(head_dim)
        if self._workspace is None or self._workspace.device != device:
            self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
            self._decode = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(self._workspace, "NHD")
            self._prefill = self._flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
        num_heads = q.shape[1]
        kv_lens = batch.kv_lens.to(device=device, dtype=torch.int32)
        pages_per_seq = (kv_lens + page_size - 1) // page_size
        indptr = torch.zeros(batch.num_seqs + 1, dtype=torch.int32, device=device)
        indptr[1:] = torch.cumsum(pages_per_seq, 0)
        table = batch.block_table.to(device)
        used = torch.arange(table.shape[1], device=device)[None, :] < pages_per_seq[:, None]
        indices = table[used].to(torch.int32)                          # row-major: sequence by sequence
        last_page_len = kv_lens - (pages_per_seq - 1).clamp(min=0) * page_size
        if batch.is_decode:
            self._decode.plan(indptr, indices, last_page_len, num_heads, num_kv_heads, head_dim, page_size,
                              pos_encoding_mode="NONE", q_data_type=q.dtype, kv_data_type=k_cache.dtype,
                              sm_scale=scale)
        else:
            self._prefill.plan(batch.query_start_loc.to(device=device, dtype=torch.int32), indptr, indices,
                               last_page_len, num_heads, num_kv_heads, head_dim, page_size, causal=True,
                               pos_encoding_mode="NONE", q_data_type=q.dtype, kv_data_type=k_cache.dtype,
                               sm_scale=scale)
