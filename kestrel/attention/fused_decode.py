"""Attention prologue + decode attention in one launch (an experiment, off by default).

On the CUDA fast path a decode step's attention is otherwise two Triton launches per layer:
qk_norm_rope_store (layers/attention_prologue.py: q/k RMSNorm, rotary, K/V cache write) and decode_attention
(triton_kernels.py: split-K flash-decoding). decode_attention_from_qkv does both in one launch with decode's grid
(sequence, kv head, split), reading the QKV projection's output qkv [S, (Hq + 2 Hkv) * D] in place:

  q: every program with a non-empty slice normalises and rotates the GROUP query heads of its kv head itself
     (_norm_rotate_head, the prologue's own helper, one head at a time), redundantly across splits (a few hundred
     bytes per head). It rounds them to the model dtype, stores them in its *own* rows of the split-K scratch,
     partial_out[seq, heads of kv_head, split, :] (fp32 holds every 16-bit value exactly; no other program reads
     or writes those rows before this program's partial lands there), and after a CTA barrier reloads them as the
     [BLOCK_H, BLOCK_D] tile the shared decode body wants. So q is bit-identical to the prologue's q and the
     attention is the same code (_decode_split) on the same values as the two-launch path.
  k, v: the program whose slice holds position kv_len - 1 (the last used split; split 0 for kv_len == 0, so a row
     the prologue would write is written here too) normalises and rotates the new token's k, writes it and v to the
     cache at slot_mapping[seq] (slot -1: nothing), and its CTA barrier comes before its tile loop reads the slot
     back. No other program reads position kv_len - 1, so no ordering between programs is needed.
     Precondition (true of every decode batch the scheduler builds): slot_mapping[seq] is the cache slot of
     position kv_lens[seq] - 1 of seq's block table, and no other sequence's context reads that slot.

Numerics therefore equal qk_norm_rope_store then decode_attention: bit-equal caches; in fp32 the outputs agree
exactly under the interpreter (compiled, the norm's fp32 sum may be reduced in another order than the prologue's
one-warp program, an ulp in rstd). Same conventions as decode_attention: PDL (pdl_wait first), grid and per-split
lengths from shapes only (CUDA-graph safe, no host sync), the DecodeScratch partials and counters, both merge modes.

Switched on by KESTREL_FUSED_DECODE_PROLOGUE=1 (TritonAttentionBackend.decodes_from_qkv; models/llama.py
Attention.attend). Off by default: on the H200 it removed the predicted 28 launches per Qwen3-0.6B decode step
but the step took 0.864 ms against 0.853 (predicted -7%): inside one program rotate -> write K/V -> barrier ->
attend run in series, while as two PDL launches the attention kernel's start already overlapped the prologue.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kestrel.attention.triton_kernels import (
    LOG2E, _check_cache, _decode_split, _decode_split_range, _decode_zero_output, decode_meta, decode_reduce,
    decode_scratch,
)
from kestrel.layers.attention_prologue import _norm_rotate_head, cos_sin_at, write_new_kv
from kestrel.layers.pdl import launch_options, pdl_wait


def fused_decode_enabled() -> bool:
    """KESTREL_FUSED_DECODE_PROLOGUE=1 turns the one-launch prologue + decode on (default off: an experiment)."""
    return os.environ.get("KESTREL_FUSED_DECODE_PROLOGUE", "0") == "1"


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
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    pdl_wait(USE_PDL)   # qkv, positions, slots and the counters come from earlier kernels / copies

    kv_len = tl.load(kv_lens_ptr + seq)
    start, end, used_splits = _decode_split_range(kv_len, split, num_splits, BLOCK_N)
    cols = tl.arange(0, BLOCK_HALF)
    mask = cols < HALF
    row = qkv_ptr + seq.to(tl.int64) * stride_qkv
    cos, sin = cos_sin_at(positions_ptr, cos_sin_ptr, seq, stride_cos_sin, cols, mask, HALF)

    # The new token (position kv_len - 1) lies in the last used split; with kv_len == 0 split 0 stands in.
    if split == tl.maximum(used_splits - 1, 0):
        slot = tl.load(slot_ptr + seq).to(tl.int64)
        if slot >= 0:   # slot -1 marks padding: nothing to write
            write_new_kv(row, k_norm_ptr, cos, sin, eps, cols, mask, slot, kv_head, k_cache_ptr, v_cache_ptr,
                         stride_kc_block, stride_kc_off, stride_kc_head, stride_vc_block, stride_vc_off,
                         stride_vc_head, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, HALF, BLOCK_SIZE, HAS_K_NORM)

    if start < end:
        # q of the GROUP heads, rounded to the model dtype like the prologue's q, into this program's own rows of
        # partial_out (split `split`); _decode_split overwrites them with the partial only after a barrier.
        q_rows = part_out_ptr + seq * stride_po_s + split * stride_po_split
        for h in tl.static_range(GROUP):
            head = kv_head * GROUP + h
            q1, q2 = _norm_rotate_head(row + head * HEAD_DIM, q_norm_ptr, cos, sin, eps, cols, mask,
                                       HAS_Q_NORM, HEAD_DIM, HALF)
            dst = q_rows + head * stride_po_h
            tl.store(dst + cols, q1.to(qkv_ptr.dtype.element_ty).to(tl.float32), mask=mask)
            tl.store(dst + HALF + cols, q2.to(qkv_ptr.dtype.element_ty).to(tl.float32), mask=mask)
        # One CTA barrier: the q rows, and in the writer the new K/V, are visible to all of its threads.
        tl.debug_barrier()
        rows = tl.arange(0, BLOCK_H)
        dims = tl.arange(0, BLOCK_D)
        q = tl.load(q_rows + (kv_head * GROUP + rows)[:, None] * stride_po_h + dims[None, :],
                    mask=(rows[:, None] < GROUP) & (dims[None, :] < HEAD_DIM), other=0.0)
        q = q.to(qkv_ptr.dtype.element_ty)   # exact: the values were rounded to this dtype
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
                      INTERPRET, MERGE, BLOCK_S, True, 0, 0, False)
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
        BLOCK_SIZE=block_size, **meta, **pdl,
    )
    if not meta["MERGE"]:
        decode_reduce(partials, kv_lens, out, num_splits, meta, pdl)
    return out
