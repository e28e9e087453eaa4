r"""Multi-head latent attention (DeepSeek-V2/V3) over a latent KV cache, in torch: the CPU road and the oracle.

Each token caches one vector that every head shares, instead of K and V per KV head:

    latent_cache: [num_blocks, block_size, 1, kv_lora_rank + rope]      (ModelRunner allocates one per layer)
      entry = c_kv (kv_lora_rank: kv_a_proj_with_mqa's latent, after kv_a_layernorm) | k_pe (rope dims, rotated)
      token p of a sequence lives at block_table[p // block_size], offset p % block_size, as in every cache

Head h's key and value are up-projections of c_kv through kv_b_proj, whose rows are per head [W_UK_h | W_UV_h]:

    k_h = [W_UK_h c_kv, k_pe]       v_h = W_UV_h c_kv          W_UK_h: [nope, kv_lora_rank], W_UV_h: [v, kv_lora_rank]

Two forms of the same attention, chosen per step by its longest query:

  decode (every query 1 token): absorbed. W_UK folds into the query and W_UV comes after the attention, so
  nothing is up-projected per cached token:

    q_h . k_h = (W_UK_h^T q_nope_h) . c_kv + q_pe_h . k_pe     q'_h = [W_UK_h^T q_nope_h, q_pe_h]  (kv_lora + rope)
    o_h       = W_UV_h (sum_j p_j c_kv_j)

    i.e. multi-query attention of head width kv_lora_rank + rope over the cache exactly as stored, whose values
    are the first kv_lora_rank dims of the keys.

  prefill, chunks, verify steps (a query of several tokens): up-projected. The cached blocks the step reads are
  expanded to per-head K [nope + rope] and V [v] once, and the step attends as multi-head attention: scores of
  width nope + rope instead of kv_lora + rope, which is what a long query pays for.

Both run through the paged torch reference (attention/torch_ref.py), so prefix hits, chunked prefill and tree
masks take their usual paths; tests/test_mla.py holds the two forms equal.

On CUDA with the triton backend the absorbed decode's MQA is its split-K decode kernel instead
(AttentionBackend.latent_decode, kernels/triton/latent_decode.py): one launch, no host reads, so the decode CUDA
graphs capture MLA models. The up-projected form stays torch and reads block ids on the host, which is why MLA
models run prefill and verify steps eagerly (forward/startup.py).

An FP8 latent cache (--kv-cache-dtype fp8) holds entry / latent_scale in e4m3 (kernels/kv_store.py), one scale a
layer (the checkpoint's k_scale, as vLLM reads it for MLA, else 1.0); every reader multiplies it back.
"""
from __future__ import annotations

import torch

from kestrel.attention.base import AttentionBackend
from kestrel.attention.torch_ref import TorchAttentionBackend, paged_attention
from kestrel.batch import ForwardBatch
from kestrel.kernels.kv_store import dequantize, effective_scales, store_kv


def rotate_interleaved(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """DeepSeek's rotary: dims (x0, x1), (x2, x3), ... rotate as pairs. x: [T, heads, rope] -> [T, heads, rope],
    written as evens' results | odds' results (as HF writes them); q and k share the order, so dot products are
    those of the interleaved rotation. cos_sin_cache: [max_pos, rope] = cos of each pair's angle | sin."""
    cos, sin = cos_sin_cache[positions].to(x.dtype).unsqueeze(1).chunk(2, dim=-1)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1)


def write_latent(entry: torch.Tensor, latent_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 latent_scale: float = 1.0) -> None:
    """entry [T, kv_lora_rank + rope] into each token's flat slot; slot -1 (padding) is skipped."""
    if latent_cache.is_cuda:   # boolean indexing reads the mask's count on the host: no CUDA graph holds it
        write_latent_by_kernel(entry, latent_cache, slot_mapping, latent_scale)
        return
    rows = entry[:, None]
    store_kv(rows, rows, latent_cache, latent_cache, slot_mapping, latent_scale, latent_scale)


def write_latent_by_kernel(entry: torch.Tensor, latent_cache: torch.Tensor, slot_mapping: torch.Tensor,
                           latent_scale: float = 1.0) -> None:
    """write_latent through the K/V store kernel, which skips slot -1 on the device (no host sync). "K" and "V"
    are the same row into the same cache: the second write repeats the first (a token's row, not the context)."""
    from kestrel.kernels.triton.paged_attention import store_kv as store_kv_kernel

    rows = entry[:, None] if latent_cache.dtype.itemsize == 1 else entry.to(latent_cache.dtype)[:, None]
    store_kv_kernel(rows, rows, latent_cache, latent_cache, slot_mapping, latent_scale, latent_scale)


class LatentAttention:
    """One MLA layer's attention over its latent cache (module docstring), this step's latents already written."""

    def __init__(self, kv_lora_rank: int, scale: float) -> None:
        self.kv_lora_rank = kv_lora_rank
        self.scale = scale
        self.paged = TorchAttentionBackend()   # the absorbed form's MQA: keys and values are the same tensor

    def forward(self, q_nope: torch.Tensor, q_pe: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor,
                latent_cache: torch.Tensor, batch: ForwardBatch,
                backend: AttentionBackend | None = None, latent_scale: float = 1.0) -> torch.Tensor:
        """q_nope [T, H, nope], q_pe [T, H, rope] (rotated), w_uk [H, nope, kv_lora], w_uv [H, v, kv_lora]
        -> attention output [T, H, v]. backend: the runner's; its latent_decode kernel, if any, runs the
        absorbed decode's MQA (batch.max_query_len is a host int: choosing the form reads nothing back)."""
        latent_scale = effective_scales(latent_cache, latent_scale, latent_scale)[0]
        if batch.max_query_len > 1:
            return self.up_projected(q_nope, q_pe, w_uk, w_uv, latent_cache, batch, latent_scale)
        return self.absorbed(q_nope, q_pe, w_uk, w_uv, latent_cache, batch, backend, latent_scale)

    def absorbed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor,
                 latent_cache: torch.Tensor, batch: ForwardBatch,
                 backend: AttentionBackend | None = None, latent_scale: float = 1.0) -> torch.Tensor:
        q_latent = torch.einsum("thn,hnr->thr", q_nope, w_uk)
        q = torch.cat([q_latent, q_pe], dim=-1)
        # values = the whole cached entry; its rope tail comes out as junk dims and is dropped
        out = None if backend is None else backend.latent_decode(q, latent_cache, batch, self.scale, latent_scale)
        if out is None:   # no kernel for this device: the paged torch reference (the CPU road and the oracle)
            out = self.paged.forward(q, None, None, latent_cache, latent_cache, batch, self.scale, latent_scale,
                                     latent_scale)
        return torch.einsum("thr,hvr->thv", out[..., :self.kv_lora_rank], w_uv)

    def up_projected(self, q_nope: torch.Tensor, q_pe: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor,
                     latent_cache: torch.Tensor, batch: ForwardBatch, latent_scale: float = 1.0) -> torch.Tensor:
        """The blocks the step reads, up-projected into a scratch K/V cache of their own (block ids renumbered
        0..U-1 in the same block table shape), then multi-head paged attention. Reads the block ids on the host."""
        block_size = latent_cache.shape[1]
        table = batch.block_table[:, :-(-batch.max_kv_len // block_size)].clamp(min=0)   # -1 pads: junk, masked
        blocks, local_table = torch.unique(table, return_inverse=True)
        raw = latent_cache.view(torch.uint8) if latent_cache.dtype.itemsize == 1 else latent_cache   # FP8: bytes
        latent = dequantize(raw[blocks][:, :, 0].view(latent_cache.dtype), latent_scale, q_nope.dtype)
        #                                                                     [U, block_size, kv_lora + rope]
        c_kv, k_pe = latent.split([self.kv_lora_rank, q_pe.shape[-1]], dim=-1)
        heads = q_nope.shape[1]
        k_nope = torch.einsum("ubr,hnr->ubhn", c_kv, w_uk)
        k = torch.cat([k_nope, k_pe[:, :, None, :].expand(-1, -1, heads, -1)], dim=-1)   # [U, bs, H, nope + rope]
        v = torch.einsum("ubr,hvr->ubhv", c_kv, w_uv)                                      # [U, bs, H, v]
        q = torch.cat([q_nope, q_pe], dim=-1)
        return paged_attention(q, k, v, local_table, batch.query_start_loc, batch.kv_lens, batch.max_query_len,
                               batch.max_kv_len, self.scale, batch.tree_mask)
