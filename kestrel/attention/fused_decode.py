"""Attention prologue + decode attention in one launch (an experiment, off by default).

On the CUDA fast path a decode step's attention is otherwise two Triton launches per layer:
qk_norm_rope_store (layers/attention_prologue.py: q/k RMSNorm, rotary, K/V cache write) and decode_attention
(triton_kernels.py: split-K flash-decoding). decode_attention_from_qkv does both in one launch with decode's grid
(sequence, kv head, split), reading the QKV projection's output qkv [S, (Hq + 2 Hkv) * D] in place, so a layer's
chain of dependent launches loses one link (~1.6 us exposed on the Qwen3-0.6B step, session 8):

  before the PDL wait (as decode_attention): kv_len, the split's range, the rotary cos/sin at the token's
     position, and (KESTREL_DECODE_PREFETCH, on by default) the slice's first K/V tile of earlier tokens;
  after it, everything stays in registers:
  q: every program with a non-empty slice normalises and rotates the GROUP query heads of its kv head
     (_norm_rotate_head, the prologue's own helper and rounding, one head at a time; redundantly across splits,
     a few hundred bytes a head) into the [BLOCK_H, BLOCK_D] tile the shared decode body (_decode_split) takes;
  k, v: the program whose slice holds position kv_len - 1 (the last used split; split 0 for kv_len == 0) makes the
     new token's k (normalised, rotated) and v rows, attends with them in place of that cache row (NEWEST_GIVEN:
     the row is never read back), and writes them to the cache at slot_mapping[seq] (slot -1: nothing) for later
     steps. No other program reads position kv_len - 1, so no ordering between programs is needed.
     Precondition (true of every decode batch the scheduler builds): slot_mapping[seq] is the cache slot of
     position kv_lens[seq] - 1 of seq's block table, and no other sequence's context reads that slot.

Numerics therefore equal qk_norm_rope_store then decode_attention: bit-equal caches; in fp32 the outputs agree
exactly under the interpreter (compiled, the norm's fp32 sum may be reduced in another order than the prologue's
one-warp program, an ulp in rstd). Same conventions as decode_attention: PDL, grid and per-split lengths from
shapes only (CUDA-graph safe, no host sync), the DecodeScratch partials and counters, both merge modes. head_dim
must be a power of two (the q/k rows are built from their two halves in registers).

Switched on by KESTREL_FUSED_DECODE_PROLOGUE=1 (TritonAttentionBackend.decodes_from_qkv; models/llama.py
Attention.attend). History: the first version (session 4) wrote q and the new K/V to memory, then a CTA barrier,
then read them back, with no prefetch; on the H200 it removed the 28 launches but the 0.6B step took 0.864 ms
against 0.853 (+1%; predicted -7%): rotate -> write -> barrier -> attend ran in series inside each program. This
version (session 9) keeps them in registers and prefetches like decode_attention; on the H200 (session 10) the
0.6B step took +2.6% and the 8B's −0.7% (twice), so it stays off (BENCHMARKS.md).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kestrel.attention.triton_kernels import (
    LOG2E, _check_cache, _decode_split, _decode_split_range, _decode_zero_output, _load_kv_tile, decode_meta,
    decode_reduce, decode_scratch, prefetch_before_wait,
)
from kestrel.layers.attention_prologue import _norm_rotate_head, cos_sin_at, new_v_halves, store_new_kv
from kestrel.layers.pdl import launch_options, pdl_wait


def fused_decode_enabled() -> bool:
    """KESTREL_FUSED_DECODE_PROLOGUE=1 turns the one-launch prologue + decode on (default off: an experiment)."""
    return os.environ.get("KESTREL_FUSED_DECODE_PROLOGUE", "0") == "1"


@triton.jit
def _row(h1, h2, HALF: tl.constexpr):
    """A head's two halves [HALF] side by side, as the head lies in memory: [2 * HALF]."""
    return tl.reshape(tl.permute(tl.join(h1, h2), (1, 0)), (2 * HALF,))


@triton.jit
def _head_row(src, weight_ptr, cos, sin, eps, cols, mask,
              HAS_NORM: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr, DTYPE: tl.constexpr):
    """One head normalised and rotated (_norm_rotate_head, the prologue's numerics) as a [2 * HALF] row in DTYPE;
    and its halves."""
    h1, h2 = _norm_rotate_head(src, weight_ptr, cos, sin, eps, cols, mask, HAS_NORM, HEAD_DIM, HALF)
    h1 = h1.to(DTYPE)
    h2 = h2.to(DTYPE)
    return _row(h1, h2, HALF), h1, h2


@triton.jit
def _decode_from_qkv_kernel(
    qkv_ptr, q_norm_ptr, k_norm_ptr, positions_ptr, cos_sin_ptr, slot_ptr,
    k_cache_ptr, v_cache_ptr, block_table_ptr, kv_lens_ptr, out_ptr, part_out_ptr, part_lse_ptr, counter_ptr,
    scale_log2, eps,
    num_splits,
    stride_qkv, stride_cos_sin,
    stride_kc_block, stride_kc_off, stride_kc_head,
    stride_vc_block, stride_vc_off, stride_vc_head,
    stride_bt,
    stride_os, stride_oh,
    stride_po_s, stride_po_h, stride_po_split,
    stride_pl_s, stride_pl_h,
    stride_cnt_s,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
    HAS_Q_NORM: tl.constexpr, HAS_K_NORM: tl.constexpr,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr, MERGE: tl.constexpr, BLOCK_S: tl.constexpr, USE_PDL: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    cols = tl.arange(0, BLOCK_HALF)
    mask = cols < HALF
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    # Before the wait, only what no kernel of this step writes (as in decode_attention): kv_lens, the block table,
    # positions and the rotary table (copied in before the step), and the K/V of every earlier token.
    kv_len = tl.load(kv_lens_ptr + seq)
    start, end, used_splits = _decode_split_range(kv_len, split, num_splits, BLOCK_N)
    cos, sin = cos_sin_at(positions_ptr, cos_sin_ptr, seq, stride_cos_sin, cols, mask, HALF)
    if PREFETCH:
        k_first, v_first = _load_kv_tile(start, start, tl.minimum(end, kv_len - 1),
                                         block_table_ptr + seq * stride_bt, k_cache_ptr + kv_head * stride_kc_head,
                                         v_cache_ptr + kv_head * stride_vc_head, stride_kc_block, stride_kc_off,
                                         stride_vc_block, stride_vc_off, dims, dim_mask, BLOCK_N, BLOCK_SIZE)
    else:
        k_first, v_first = 0, 0   # unused
    pdl_wait(USE_PDL)   # qkv and the counters come from earlier kernels

    row = qkv_ptr + seq.to(tl.int64) * stride_qkv
    dtype = qkv_ptr.dtype.element_ty
    # The new token (position kv_len - 1) lies in the last used split; with kv_len == 0 split 0 stands in. That
    # program computes its k and v row in registers, attends with them, and writes them to the cache slot.
    k_row = tl.zeros([2 * HALF], dtype)
    v_row = tl.zeros([2 * HALF], dtype)
    if split == tl.maximum(used_splits - 1, 0):
        k_row, k1, k2 = _head_row(row + (NUM_HEADS + kv_head) * HEAD_DIM, k_norm_ptr, cos, sin, eps, cols, mask,
                                  HAS_K_NORM, HEAD_DIM, HALF, dtype)
        v1, v2 = new_v_halves(row, kv_head, cols, mask, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, HALF)
        v_row = _row(v1, v2, HALF)
        slot = tl.load(slot_ptr + seq).to(tl.int64)
        if slot >= 0:   # slot -1 marks padding: nothing to write
            store_new_kv(k1, k2, v1, v2, slot, kv_head, k_cache_ptr, v_cache_ptr, cols, mask,
                         stride_kc_block, stride_kc_off, stride_kc_head, stride_vc_block, stride_vc_off,
                         stride_vc_head, HALF, BLOCK_SIZE)

    if start < end:
        # q of the GROUP heads in registers, [BLOCK_H, BLOCK_D] (rows past GROUP zero), rounded like the prologue's
        rows = tl.arange(0, BLOCK_H)
        q = tl.zeros([BLOCK_H, BLOCK_D], dtype)
        for h in tl.static_range(GROUP):
            q_row, _, _ = _head_row(row + (kv_head * GROUP + h) * HEAD_DIM, q_norm_ptr, cos, sin, eps, cols, mask,
                                    HAS_Q_NORM, HEAD_DIM, HALF, dtype)
            q = tl.where((rows == h)[:, None], q_row[None, :], q)
        if DOT_FP32:
            q = q.to(tl.float32)
        _decode_split(q, seq, kv_head, split, kv_len, start, end, used_splits,
                      k_cache_ptr, v_cache_ptr, block_table_ptr, out_ptr, part_out_ptr, part_lse_ptr, counter_ptr,
                      scale_log2,
                      stride_kc_block, stride_kc_off, stride_kc_head,
                      stride_vc_block, stride_vc_off, stride_vc_head,
                      stride_bt, stride_os, stride_oh,
                      stride_po_s, stride_po_h, stride_po_split, stride_pl_s, stride_pl_h, stride_cnt_s,
                      GROUP, HEAD_DIM, BLOCK_H, BLOCK_D, BLOCK_N, BLOCK_SIZE, DOT_FP32, DOT_PRECISION,
                      INTERPRET, MERGE, BLOCK_S, True, k_first, v_first, PREFETCH, k_row, v_row)
    elif split == 0 and kv_len == 0:   # a padded row of a graph batch: output 0, counter untouched
        _decode_zero_output(out_ptr, seq, kv_head, stride_os, stride_oh, GROUP, HEAD_DIM, BLOCK_H, BLOCK_D)


def decode_attention_from_qkv(
    qkv: torch.Tensor,                 # [S, (Hq + 2 Hkv) * D], one decode token per sequence
    q_norm_w: torch.Tensor | None,     # [D] in qkv's dtype, or None (no qk-norm)
    k_norm_w: torch.Tensor | None,
    eps: float,
    positions: torch.Tensor,           # [S] int64
    cos_sin_cache: torch.Tensor,       # [max_position, D] = [cos | sin] fp32
    k_cache: torch.Tensor,             # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,        # [S] int64, the slot of position kv_lens[s] - 1; -1: not written
    block_table: torch.Tensor,         # [S, max_blocks] int32
    kv_lens: torch.Tensor,             # [S] int32, new token included; 0 for padded rows (output 0)
    num_heads: int, num_kv_heads: int, head_dim: int,
    scale: float,
    num_splits: int | None = None,
    partials=None,                     # DecodeScratch, as for decode_attention
) -> torch.Tensor:
    """qk_norm_rope_store followed by decode_attention, in one launch: returns the attention output [S, Hq, D]
    and leaves the caches as qk_norm_rope_store leaves them."""
    num_seqs = qkv.shape[0]
    assert qkv.dim() == 2 and qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim, \
        f"qkv {tuple(qkv.shape)} is not [S, ({num_heads} + 2 * {num_kv_heads}) * {head_dim}]"
    assert qkv.stride(-1) == 1, "qkv rows must be contiguous"
    assert num_heads % num_kv_heads == 0, f"{num_heads} query heads do not group over {num_kv_heads} kv heads"
    assert head_dim % 2 == 0 and cos_sin_cache.shape[-1] == head_dim and cos_sin_cache.stride(-1) == 1, \
        f"cos_sin_cache {tuple(cos_sin_cache.shape)}: partial rotary is not supported, rot_dim must be {head_dim}"
    assert head_dim & (head_dim - 1) == 0, f"head_dim {head_dim}: the in-register q/k rows need a power of two"
    for w in (q_norm_w, k_norm_w):
        assert w is None or (w.shape == (head_dim,) and w.dtype == qkv.dtype and w.stride(-1) == 1), \
            "qk-norm weights must be [head_dim] in qkv's dtype"
    _check_cache(k_cache, v_cache)
    assert k_cache.shape[2:] == (num_kv_heads, head_dim)
    assert kv_lens.shape[0] == num_seqs and block_table.shape[0] == num_seqs, "one decode token per sequence"
    out = torch.empty(num_seqs, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if num_seqs == 0:
        return out
    block_size = k_cache.shape[1]
    num_splits, partials = decode_scratch(num_seqs, num_heads, num_kv_heads, head_dim, block_table, block_size,
                                          qkv.device, num_splits, partials)
    part_out, part_lse, counters = partials
    meta = decode_meta(qkv, num_heads // num_kv_heads, head_dim, num_splits)
    pdl = launch_options(qkv.device)
    half = head_dim // 2
    _decode_from_qkv_kernel[(num_seqs, num_kv_heads, num_splits)](
        qkv,
        q_norm_w if q_norm_w is not None else qkv, k_norm_w if k_norm_w is not None else qkv,   # unused if None
        positions, cos_sin_cache, slot_mapping,
        k_cache, v_cache, block_table, kv_lens, out, part_out, part_lse, counters,
        scale * LOG2E, eps, num_splits,
        qkv.stride(0), cos_sin_cache.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0),
        out.stride(0), out.stride(1),
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        counters.stride(0),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HALF=half, BLOCK_HALF=triton.next_power_of_2(half),
        HAS_Q_NORM=q_norm_w is not None, HAS_K_NORM=k_norm_w is not None,
        BLOCK_SIZE=block_size, PREFETCH=prefetch_before_wait(), **meta, **pdl,
    )
    if not meta["MERGE"]:
        decode_reduce(partials, kv_lens, out, num_splits, meta, pdl)
    return out
