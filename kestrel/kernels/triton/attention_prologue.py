"""The attention prologue in one kernel: per-head q/k RMSNorm (Qwen3), rotary, and the paged K/V write.

Between the fused QKV GEMM and attention the layer otherwise launches, on the CUDA fast path (fused_ops on,
Triton backend), per layer (counted by running Attention.forward with every launch logged):

                                                 Qwen3 (qk-norm)          Llama / Mistral / Qwen2
                                                 T = 1     T >= 2         any T
      q RMSNorm: [reshape copy +] rms_norm         1         2              -
      k RMSNorm: [reshape copy +] rms_norm         1         2              -
      apply_rotary (q and k, in place)             1         1              1
      store_kv (k and v into the paged cache)      1         1              1
      ------------------------------------------------------------------------------
      before -> with qk_norm_rope_store          4 -> 1    6 -> 1         2 -> 1

(The copy: fused_ops.rms_norm reshapes [T, H, D] to [T * H, D], a view of qkv's head slice only when T = 1.)
So a batch-1 Qwen3-0.6B decode step (28 layers) loses 84 launches, a batched decode or prefill step 140; a
Llama-3-8B step (32 layers) loses 32.

Input, the QKV projection's output, read in place through strides (no copies):

    qkv: [T, (Hq + 2 * Hkv) * D] = [ q head 0 .. q head Hq-1 | k head 0 .. Hkv-1 | v head 0 .. Hkv-1 ]

One program per (token, head): programs 0 .. Hq-1 normalise and rotate a q head into the returned q; programs
Hq .. Hq+Hkv-1 normalise and rotate a k head and copy the matching v head into the cache at the token's slot
(slot -1 marks padding: nothing written). q comes back as a new contiguous [T, Hq, D] tensor rather than rotated
in place inside qkv: the bytes moved are the same either way, the GEMM output stays untouched (no aliasing, the
reference is a pure function) and the attention kernels read a dense q.

Numerics follow the references in fused_ops.py (HF's roundings): the norm rounds x * rstd to the model dtype,
then the weight product; rotary casts cos/sin to the model dtype and rounds each product. Launched with PDL on Hopper
(kestrel/kernels/triton/pdl.py). No host syncs: the wrapper reads only shapes, so the kernel can be captured in a CUDA graph.
"""
from __future__ import annotations

from typing import Callable

import torch
import triton
import triton.language as tl

from kestrel.kernels import kv_store
from kestrel.kernels.triton.fused_ops import HF_ROUNDING, apply_rotary_ref, rms_norm_ref
from kestrel.kernels.triton.paged_attention import fp8_quantize
from kestrel.kernels.triton.pdl import launch_options, pdl_wait


def qk_norm_rope_store_ref(qkv: torch.Tensor, q_norm_w: torch.Tensor | None, k_norm_w: torch.Tensor | None,
                           eps: float, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                           k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                           num_heads: int, num_kv_heads: int, head_dim: int,
                           store_kv: Callable[..., None] = kv_store.store_kv, k_scale: float = 1.0,
                           v_scale: float = 1.0) -> torch.Tensor:
    """Torch twin of qk_norm_rope_store, composed of the existing references; returns q [T, Hq, D].
    store_kv=kv_store.store_kv_unpadded makes it capturable where no slot is padding."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.reshape(-1, num_heads, head_dim)
    k = k.reshape(-1, num_kv_heads, head_dim)
    v = v.reshape(-1, num_kv_heads, head_dim)
    if q_norm_w is not None:
        q = rms_norm_ref(q, q_norm_w, eps)
    if k_norm_w is not None:
        k = rms_norm_ref(k, k_norm_w, eps)
    q, k = apply_rotary_ref(q, k, positions, cos_sin_cache)
    store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return q.contiguous()


@triton.jit
def _norm_rotate_head(src, weight_ptr, cos, sin, eps, cols, mask,
                      HAS_NORM: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr):
    """One head at src: optional RMSNorm over its HEAD_DIM values, then rotate pairs (i, i + HALF)."""
    x1 = tl.load(src + cols, mask=mask, other=0.0)
    x2 = tl.load(src + HALF + cols, mask=mask, other=0.0)
    dtype = x1.dtype
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    if HAS_NORM:
        rstd = tl.rsqrt((tl.sum(x1f * x1f, 0) + tl.sum(x2f * x2f, 0)) / HEAD_DIM + eps)
        w1 = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        w2 = tl.load(weight_ptr + HALF + cols, mask=mask, other=0.0).to(tl.float32)
        # HF: weight * (x * rstd).to(dtype), the product rounded to the model dtype again
        x1f = (w1 * (x1f * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x2f = (w2 * (x2f * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    c = cos.to(dtype).to(tl.float32)
    s = sin.to(dtype).to(tl.float32)
    out1 = (x1f * c).to(dtype).to(tl.float32) - (x2f * s).to(dtype).to(tl.float32)
    out2 = (x2f * c).to(dtype).to(tl.float32) + (x1f * s).to(dtype).to(tl.float32)
    return out1, out2


@triton.jit
def cos_sin_at(positions_ptr, cos_sin_ptr, token, stride_cos_sin, cols, mask, HALF: tl.constexpr):
    """The rotary cos and sin halves [BLOCK_HALF] (fp32) at the position of `token`."""
    pos = tl.load(positions_ptr + token).to(tl.int64)
    cos = tl.load(cos_sin_ptr + pos * stride_cos_sin + cols, mask=mask, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * stride_cos_sin + HALF + cols, mask=mask, other=0.0)
    return cos, sin


@triton.jit
def new_v_halves(row, kv_head, cols, mask, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                 HEAD_DIM: tl.constexpr, HALF: tl.constexpr):
    """The two halves of v head kv_head of the qkv row at `row`, as stored (v is neither normalised nor rotated)."""
    v_src = row + (NUM_HEADS + NUM_KV_HEADS + kv_head) * HEAD_DIM
    return tl.load(v_src + cols, mask=mask, other=0.0), tl.load(v_src + HALF + cols, mask=mask, other=0.0)


@triton.jit
def store_new_kv(k1, k2, v1, v2, slot, kv_head, k_cache_ptr, v_cache_ptr, cols, mask,
                 stride_kc_block, stride_kc_off, stride_kc_head, stride_vc_block, stride_vc_off, stride_vc_head,
                 HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr, k_scale, v_scale, FP8: tl.constexpr):
    """A new token's k and v halves into the caches at `slot` (>= 0), head kv_head; an FP8 cache gets x / scale
    (paged_attention.fp8_quantize)."""
    if FP8:
        k1, k2 = fp8_quantize(k1, k_scale), fp8_quantize(k2, k_scale)
        v1, v2 = fp8_quantize(v1, v_scale), fp8_quantize(v2, v_scale)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    k_dst = k_cache_ptr + block * stride_kc_block + offset * stride_kc_off + kv_head * stride_kc_head
    tl.store(k_dst + cols, k1.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(k_dst + HALF + cols, k2.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v_dst = v_cache_ptr + block * stride_vc_block + offset * stride_vc_off + kv_head * stride_vc_head
    tl.store(v_dst + cols, v1.to(v_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst + HALF + cols, v2.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def write_new_kv(row, k_norm_ptr, cos, sin, eps, cols, mask, slot, kv_head, k_cache_ptr, v_cache_ptr,
                 stride_kc_block, stride_kc_off, stride_kc_head, stride_vc_block, stride_vc_off, stride_vc_head,
                 NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
                 BLOCK_SIZE: tl.constexpr, HAS_K_NORM: tl.constexpr, k_scale, v_scale,
                 FP8: tl.constexpr):
    """k head kv_head of the qkv row at `row`, normalised and rotated, and the matching v head, into the caches at
    `slot` (>= 0)."""
    k1, k2 = _norm_rotate_head(row + (NUM_HEADS + kv_head) * HEAD_DIM, k_norm_ptr, cos, sin, eps, cols, mask,
                               HAS_K_NORM, HEAD_DIM, HALF)
    v1, v2 = new_v_halves(row, kv_head, cols, mask, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, HALF)
    store_new_kv(k1, k2, v1, v2, slot, kv_head, k_cache_ptr, v_cache_ptr, cols, mask,
                 stride_kc_block, stride_kc_off, stride_kc_head, stride_vc_block, stride_vc_off, stride_vc_head,
                 HALF, BLOCK_SIZE, k_scale, v_scale, FP8)


@triton.jit
def _qk_norm_rope_store_kernel(
    qkv_ptr, q_out_ptr, q_norm_ptr, k_norm_ptr, positions_ptr, cos_sin_ptr,
    k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_qkv, stride_q_out_t, stride_q_out_h, stride_cos_sin,
    stride_kc_block, stride_kc_off, stride_kc_head,
    stride_vc_block, stride_vc_off, stride_vc_head,
    eps, k_scale, v_scale,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr, HAS_Q_NORM: tl.constexpr, HAS_K_NORM: tl.constexpr,
    USE_PDL: tl.constexpr, FP8: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    cols = tl.arange(0, BLOCK_HALF)
    mask = cols < HALF
    # Positions and cos/sin are read after the wait. Reading them before it (no kernel of the step writes them)
    # measured -0.5% alone on the H200 and nothing on top of decode attention's loads before its own wait.
    pdl_wait(USE_PDL)
    cos, sin = cos_sin_at(positions_ptr, cos_sin_ptr, token, stride_cos_sin, cols, mask, HALF)
    row = qkv_ptr + token * stride_qkv
    if head < NUM_HEADS:
        out1, out2 = _norm_rotate_head(row + head * HEAD_DIM, q_norm_ptr, cos, sin, eps, cols, mask,
                                       HAS_Q_NORM, HEAD_DIM, HALF)
        dst = q_out_ptr + token * stride_q_out_t + head * stride_q_out_h
        tl.store(dst + cols, out1.to(q_out_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + HALF + cols, out2.to(q_out_ptr.dtype.element_ty), mask=mask)
    else:
        kv_head = head - NUM_HEADS
        slot = tl.load(slot_ptr + token).to(tl.int64)
        if slot >= 0:   # slot -1 marks padding: nothing to write
            write_new_kv(row, k_norm_ptr, cos, sin, eps, cols, mask, slot, kv_head, k_cache_ptr, v_cache_ptr,
                         stride_kc_block, stride_kc_off, stride_kc_head, stride_vc_block, stride_vc_off,
                         stride_vc_head, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, HALF, BLOCK_SIZE, HAS_K_NORM,
                         k_scale, v_scale, FP8)


def qk_norm_rope_store(qkv: torch.Tensor, q_norm_w: torch.Tensor | None, k_norm_w: torch.Tensor | None,
                       eps: float, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                       num_heads: int, num_kv_heads: int, head_dim: int, k_scale: float = 1.0,
                       v_scale: float = 1.0) -> torch.Tensor:
    """qkv [T, (Hq + 2Hkv) * D] -> rotated q [T, Hq, D] (new); normed, rotated k and v written to the caches.
    k_scale, v_scale: an FP8 cache's (kernels/kv_store.py; ignored for any other cache dtype).

    q_norm_w / k_norm_w: [D] per-head RMSNorm weights in qkv's dtype, or None (no qk-norm).
    cos_sin_cache: [max_position, D] = [cos | sin] in fp32 (full rotary only).
    k_cache, v_cache: [num_blocks, block_size, Hkv, D]; slot_mapping [T], -1 skipped.
    """
    num_tokens = qkv.shape[0]
    assert qkv.dim() == 2 and qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim, \
        f"qkv {tuple(qkv.shape)} is not [T, ({num_heads} + 2 * {num_kv_heads}) * {head_dim}]"
    assert qkv.stride(-1) == 1, "qkv rows must be contiguous"
    assert cos_sin_cache.shape[-1] == head_dim and cos_sin_cache.stride(-1) == 1, \
        f"cos_sin_cache {tuple(cos_sin_cache.shape)}: partial rotary is not supported, rot_dim must be {head_dim}"
    for w in (q_norm_w, k_norm_w):
        assert w is None or (w.shape == (head_dim,) and w.dtype == qkv.dtype and w.stride(-1) == 1), \
            "qk-norm weights must be [head_dim] in qkv's dtype"
    assert k_cache.shape == v_cache.shape and k_cache.shape[2:] == (num_kv_heads, head_dim)
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "cache head_dim must be contiguous"
    q = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return q
    half = head_dim // 2
    k_scale, v_scale = kv_store.effective_scales(k_cache, k_scale, v_scale)
    _qk_norm_rope_store_kernel[(num_tokens, num_heads + num_kv_heads)](
        qkv, q,
        q_norm_w if q_norm_w is not None else qkv, k_norm_w if k_norm_w is not None else qkv,   # unused if None
        positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
        qkv.stride(0), q.stride(0), q.stride(1), cos_sin_cache.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        eps, k_scale, v_scale,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HALF=half,
        BLOCK_HALF=triton.next_power_of_2(half), BLOCK_SIZE=k_cache.shape[1],
        HAS_Q_NORM=q_norm_w is not None, HAS_K_NORM=k_norm_w is not None, FP8=kv_store.is_fp8(k_cache),
        num_warps=1 if head_dim <= 128 else 2,
        **launch_options(qkv.device), **HF_ROUNDING,
    )
    return q

