"""Triton kernels for paged attention: KV store, the key-tile loop every attention kernel shares, and ragged extend
(prefill / verify); split-K decode is in paged_decode.py, on the same tile loop.

Cache layout (base.py draws it): k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim];
token p of sequence s lives at block_table[s, p // block_size], offset p % block_size.

FP8 cache (kernels/kv_store.py): store_kv writes x / scale clamped to +-448 in e4m3 (FP8 constexpr); the attention
kernels take the tile as it is and upcast it as they would a bf16 one, with k_scale folded into the softmax scale
and v_scale into the output (both are per tensor, so that is the same as dequantizing every element).

The torch oracle for every kernel is kestrel/attention/torch_ref.py. On CPU tensors the kernels only run under
Triton's interpreter (TRITON_INTERPRET=1 set before triton is imported); that is how the CPU tests run them.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kestrel.kernels.kv_store import FP8_KV_MAX, effective_scales, is_fp8

LOG2E = math.log2(math.e)
FP8_MAX: tl.constexpr = tl.constexpr(FP8_KV_MAX)   # e4m3's largest finite value


# ---------------------------------------------------------------------------------------------------------------
# store_kv
# ---------------------------------------------------------------------------------------------------------------

@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    k_scale, v_scale,            # FP8: the cache holds x / scale
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kc_block, stride_kc_off, stride_kc_head,
    stride_vc_block, stride_vc_off, stride_vc_head,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, FP8: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:  # slot -1 marks padding: nothing to write
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        heads = tl.arange(0, BLOCK_H)
        dims = tl.arange(0, BLOCK_D)
        mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
        k = tl.load(k_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
        v = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
        if FP8:
            k = fp8_quantize(k, k_scale)
            v = fp8_quantize(v, v_scale)
        k_dst = k_cache_ptr + block * stride_kc_block + offset * stride_kc_off
        v_dst = v_cache_ptr + block * stride_vc_block + offset * stride_vc_off
        tl.store(k_dst + heads[:, None] * stride_kc_head + dims[None, :], k.to(k_cache_ptr.dtype.element_ty),
                 mask=mask)
        tl.store(v_dst + heads[:, None] * stride_vc_head + dims[None, :], v.to(v_cache_ptr.dtype.element_ty),
                 mask=mask)


@triton.jit
def fp8_quantize(x, scale):
    """x / scale in fp32, clamped into e4m3's range (the store casts it); kv_store.quantize is the oracle."""
    return tl.minimum(tl.maximum(x.to(tl.float32) / scale, -FP8_MAX), FP8_MAX)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Write k, v [T, Hkv, D] into the paged caches at slot_mapping [T]; slot -1 is skipped. k_scale, v_scale: an
    FP8 cache's (ignored for any other)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    k, v = _last_dim_contiguous(k), _last_dim_contiguous(v)
    _check_cache(k_cache, v_cache)
    k_scale, v_scale = effective_scales(k_cache, k_scale, v_scale)
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_SIZE=k_cache.shape[1], FP8=is_fp8(k_cache),
    )


# ---------------------------------------------------------------------------------------------------------------
# shared attention tile: online softmax of a block of query rows over BLOCK_N cached keys
# ---------------------------------------------------------------------------------------------------------------
#
# Triton 3.6's interpreter cannot use tensors as loop bounds with numpy >= 2.4 (triton-lang/triton#9171), so under
# the interpreter (INTERPRET constexpr) the kernels walk their tiles with a while loop; compiled kernels keep the
# for loop, which Triton software-pipelines. Both loops call this same tile body.

@triton.jit
def _load_kv_tile(
    n0, lo, hi,                  # the tile's keys n0 .. n0 + BLOCK_N - 1; only those in [lo, hi) are read (others 0)
    table_row, k_base, v_base,   # block-table row of the sequence; cache pointers already at the kv head
    stride_kc_block, stride_kc_off, stride_vc_block, stride_vc_off,
    dims, dim_mask,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    """K and V [BLOCK_N, BLOCK_D] of one tile of cached keys, in the cache dtype."""
    pos = n0 + tl.arange(0, BLOCK_N)
    pos_mask = (pos >= lo) & (pos < hi)
    block = tl.load(table_row + pos // BLOCK_SIZE, mask=pos_mask, other=0).to(tl.int64)
    offset = pos % BLOCK_SIZE
    kv_mask = pos_mask[:, None] & dim_mask[None, :]
    k = tl.load(k_base + block[:, None] * stride_kc_block + offset[:, None] * stride_kc_off + dims[None, :],
                mask=kv_mask, other=0.0)
    v = tl.load(v_base + block[:, None] * stride_vc_block + offset[:, None] * stride_vc_off + dims[None, :],
                mask=kv_mask, other=0.0)
    return k, v


@triton.jit
def _attend_kv(
    q, m_i, l_i, acc,            # q [R, BLOCK_D]; running max, sum [R]; acc [R, BLOCK_D] fp32
    k, v, n0, kv_end, row_pos,   # the tile's keys n0 .. n0 + BLOCK_N - 1 (loaded), those below kv_end count;
    scale_log2,                  # row r sees keys at <= row_pos[r]
    BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One step of the online softmax over a loaded K/V tile, causal."""
    pos = n0 + tl.arange(0, BLOCK_N)
    visible = (pos[None, :] <= row_pos[:, None]) & (pos[None, :] < kv_end)
    return _softmax_step(q, m_i, l_i, acc, k, v, visible, scale_log2, DOT_FP32, DOT_PRECISION)


@triton.jit
def _softmax_step(
    q, m_i, l_i, acc,            # q [R, BLOCK_D]; running max, sum [R]; acc [R, BLOCK_D] fp32
    k, v, visible,               # a loaded K/V tile and which of its keys each row sees [R, BLOCK_N]
    scale_log2, DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """The online-softmax update for one tile; callers guarantee every row sees a key in its first tile, so the
    running max is finite from then on."""
    if DOT_FP32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    else:
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2    # [R, BLOCK_N], log2 units
    scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    p = tl.exp2(scores - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _attend_tile(
    q, m_i, l_i, acc,            # q [R, BLOCK_D]; running max, sum [R]; acc [R, BLOCK_D] fp32
    n0, kv_end, row_pos,         # keys n0 .. n0 + BLOCK_N - 1 below kv_end; row r sees keys at <= row_pos[r]
    table_row, k_base, v_base,   # block-table row of the sequence; cache pointers already at the kv head
    stride_kc_block, stride_kc_off, stride_vc_block, stride_vc_off,
    dims, dim_mask, scale_log2,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    k, v = _load_kv_tile(n0, n0, kv_end, table_row, k_base, v_base, stride_kc_block, stride_kc_off,
                         stride_vc_block, stride_vc_off, dims, dim_mask, BLOCK_N, BLOCK_SIZE)
    return _attend_kv(q, m_i, l_i, acc, k, v, n0, kv_end, row_pos, scale_log2, BLOCK_N, DOT_FP32, DOT_PRECISION)


@triton.jit
def _attend_tree_tile(
    q, m_i, l_i, acc,            # q [R, BLOCK_D]; running max, sum [R]; acc [R, BLOCK_D] fp32
    n0, step_start, kv_end,      # the step's keys n0 .. n0 + BLOCK_N - 1 (n0 >= step_start) below kv_end
    tree_rows, row_mask,         # mask pointers at each row's tree_mask[s, i, 0]; rows past q_len masked off
    table_row, k_base, v_base,   # block-table row of the sequence; cache pointers already at the kv head
    stride_kc_block, stride_kc_off, stride_vc_block, stride_vc_off,
    dims, dim_mask, scale_log2,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """_attend_tile for a tile of the step's own keys in a tree step: row i sees key j iff tree_mask[s, i, j]."""
    k, v = _load_kv_tile(n0, n0, kv_end, table_row, k_base, v_base, stride_kc_block, stride_kc_off,
                         stride_vc_block, stride_vc_off, dims, dim_mask, BLOCK_N, BLOCK_SIZE)
    pos = n0 + tl.arange(0, BLOCK_N)
    bits = tl.load(tree_rows[:, None] + (pos - step_start)[None, :],
                   mask=row_mask[:, None] & (pos < kv_end)[None, :], other=0)
    visible = (bits != 0) | (row_mask[:, None] == 0)   # padded rows see everything: finite, never stored
    # A real row sees a key before the step or the root (the step's first key) before any other step key.
    return _softmax_step(q, m_i, l_i, acc, k, v, visible, scale_log2, DOT_FP32, DOT_PRECISION)


# ---------------------------------------------------------------------------------------------------------------
# extend: ragged query chunks (prefill, chunked prefill, speculative verify) over the paged cache
# ---------------------------------------------------------------------------------------------------------------
#
# One program per (query tile, sequence, query head). Query i of sequence s sits at cache index
# kv_len - q_len + i and sees keys at indices <= its own; the new tokens are already in the cache, so the
# keys are read from the cache only. The loop stops at the tile's last query position (causal skip).
#
# TREE (a tree verify step; tree_mask drawn in kestrel/attention/base.py): the keys before the step run through
# the same causal tiles (every row's index is past them all), then the step's own keys [kv_len - q_len, kv_len)
# run through _attend_tree_tile, which reads the tree_mask bits of the query tile x key tile. Without TREE the
# tree_mask arguments are None and the kernel compiles as the causal one.

@triton.jit
def _extend_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, query_start_ptr, kv_lens_ptr, out_ptr,
    tree_mask_ptr,               # [S, Q, Q] uint8 (a bool mask's bytes) when TREE; it and its strides None else
    scale_log2,                  # softmax scale * k_scale * log2(e)
    v_scale,                     # 1.0 but for an FP8 cache
    stride_qt, stride_qh,
    stride_kc_block, stride_kc_off, stride_kc_head,
    stride_vc_block, stride_vc_off, stride_vc_head,
    stride_bt,
    stride_ot, stride_oh,
    stride_tm_seq, stride_tm_row,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr, TREE: tl.constexpr,
):
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // GROUP

    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    kv_len = tl.load(kv_lens_ptr + seq)
    m0 = tile * BLOCK_M
    if m0 < q_len:
        rows = m0 + tl.arange(0, BLOCK_M)
        row_mask = rows < q_len
        row_pos = kv_len - q_len + rows   # >= 0, so key 0 is visible to every row (padded rows included)
        dims = tl.arange(0, BLOCK_D)
        dim_mask = dims < HEAD_DIM
        tokens = (q_start + rows).to(tl.int64)
        q = tl.load(q_ptr + tokens[:, None] * stride_qt + head * stride_qh + dims[None, :],
                    mask=row_mask[:, None] & dim_mask[None, :], other=0.0)
        if DOT_FP32:
            q = q.to(tl.float32)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        table_row = block_table_ptr + seq * stride_bt
        k_base = k_cache_ptr + kv_head * stride_kc_head
        v_base = v_cache_ptr + kv_head * stride_vc_head
        if TREE:
            kv_end = kv_len - q_len   # the keys before the step: every row sees them all
        else:
            kv_end = tl.minimum(kv_len, kv_len - q_len + m0 + BLOCK_M)   # causal: nothing past the tile's last row
        if INTERPRET:
            n0 = 0
            while n0 < kv_end:
                m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, n0, kv_end, row_pos, table_row, k_base, v_base,
                                             stride_kc_block, stride_kc_off, stride_vc_block, stride_vc_off,
                                             dims, dim_mask, scale_log2, BLOCK_N, BLOCK_SIZE, DOT_FP32,
                                             DOT_PRECISION)
                n0 += BLOCK_N
        else:
            for n0 in range(0, kv_end, BLOCK_N):
                m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, n0, kv_end, row_pos, table_row, k_base, v_base,
                                             stride_kc_block, stride_kc_off, stride_vc_block, stride_vc_off,
                                             dims, dim_mask, scale_log2, BLOCK_N, BLOCK_SIZE, DOT_FP32,
                                             DOT_PRECISION)
        if TREE:
            step_start = kv_len - q_len
            tree_rows = tree_mask_ptr + seq.to(tl.int64) * stride_tm_seq + rows * stride_tm_row
            if INTERPRET:
                n0 = step_start
                while n0 < kv_len:
                    m_i, l_i, acc = _attend_tree_tile(q, m_i, l_i, acc, n0, step_start, kv_len, tree_rows,
                                                      row_mask, table_row, k_base, v_base, stride_kc_block,
                                                      stride_kc_off, stride_vc_block, stride_vc_off, dims, dim_mask,
                                                      scale_log2, BLOCK_N, BLOCK_SIZE, DOT_FP32, DOT_PRECISION)
                    n0 += BLOCK_N
            else:
                for n0 in range(step_start, kv_len, BLOCK_N):
                    m_i, l_i, acc = _attend_tree_tile(q, m_i, l_i, acc, n0, step_start, kv_len, tree_rows,
                                                      row_mask, table_row, k_base, v_base, stride_kc_block,
                                                      stride_kc_off, stride_vc_block, stride_vc_off, dims, dim_mask,
                                                      scale_log2, BLOCK_N, BLOCK_SIZE, DOT_FP32, DOT_PRECISION)

        out = acc * (v_scale / l_i[:, None])
        tl.store(out_ptr + tokens[:, None] * stride_ot + head * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & dim_mask[None, :])


def extend_attention(
    q: torch.Tensor,                # [T, Hq, D], the ragged query chunks of all sequences, concatenated
    k_cache: torch.Tensor,          # [num_blocks, block_size, Hkv, D], new tokens already written
    v_cache: torch.Tensor,
    block_table: torch.Tensor,      # [S, max_blocks] int32
    query_start_loc: torch.Tensor,  # [S + 1] int32
    kv_lens: torch.Tensor,          # [S] int32, cache length after this step
    max_query_len: int,             # host int: sizes the grid
    scale: float,
    tree_mask: torch.Tensor | None = None,   # [S, max_query_len, max_query_len] bool: a tree verify step
    k_scale: float = 1.0,           # an FP8 cache's scales (ignored for any other cache dtype)
    v_scale: float = 1.0,
) -> torch.Tensor:
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = kv_lens.shape[0]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    assert num_heads % num_kv_heads == 0, f"{num_heads} query heads do not group over {num_kv_heads} kv heads"
    _check_cache(k_cache, v_cache)
    q = _last_dim_contiguous(q)
    out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs == 0:
        return out
    tree_bytes, tm_seq, tm_row = None, None, None   # None: constexpr, so the causal kernel compiles as before
    if tree_mask is not None:
        assert tree_mask.dtype == torch.bool and tree_mask.shape[0] == num_seqs, \
            f"tree_mask must be bool [{num_seqs}, Q, Q], got {tree_mask.dtype} {tuple(tree_mask.shape)}"
        assert tree_mask.shape[1] == tree_mask.shape[2] >= max_query_len, \
            f"tree_mask {tuple(tree_mask.shape)} does not cover max_query_len {max_query_len}"
        tree_bytes = _last_dim_contiguous(tree_mask).view(torch.uint8)
        tm_seq, tm_row = tree_bytes.stride(0), tree_bytes.stride(1)
    tiles = _extend_tiles(q)
    grid = (triton.cdiv(max_query_len, tiles["BLOCK_M"]), num_seqs, num_heads)
    k_scale, v_scale = effective_scales(k_cache, k_scale, v_scale)
    _extend_kernel[grid](
        q, k_cache, v_cache, block_table, query_start_loc, kv_lens, out,
        tree_bytes,
        scale * k_scale * LOG2E, v_scale,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0),
        out.stride(0), out.stride(1),
        tm_seq, tm_row,
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_M=tiles["BLOCK_M"], BLOCK_N=tiles["BLOCK_N"],
        BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size,
        DOT_FP32=_dot_in_fp32(q), DOT_PRECISION=_dot_precision(q), INTERPRET=_interpreted(),
        TREE=tree_mask is not None,
        num_warps=tiles["num_warps"], num_stages=tiles["num_stages"],
    )
    return out


# ---------------------------------------------------------------------------------------------------------------
# launch helpers
# ---------------------------------------------------------------------------------------------------------------

def _extend_tiles(q: torch.Tensor) -> dict[str, int]:
    if _interpreted():
        return {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 1, "num_stages": 1}
    if q.shape[2] > 128:
        return {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1}
    return {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}


def _dot_precision(q: torch.Tensor) -> str:
    # fp32 models are the parity path: keep fp32 dots exact instead of TF32.
    return "ieee" if q.dtype == torch.float32 else "tf32"


def _dot_in_fp32(q: torch.Tensor) -> bool:
    # Triton 3.6's interpreter returns garbage for bf16 tl.dot (fp16 and fp32 are fine), so interpreted kernels
    # upcast bf16 operands; compiled ones keep bf16 for the tensor cores.
    return _interpreted() and q.dtype == torch.bfloat16


def _interpreted() -> bool:
    return bool(triton.knobs.runtime.interpret)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    assert k_cache.shape == v_cache.shape, f"k_cache {tuple(k_cache.shape)} != v_cache {tuple(v_cache.shape)}"
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "cache head_dim must be contiguous"
