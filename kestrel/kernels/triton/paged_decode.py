"""Triton split-K decode attention over the paged KV cache: one launch per step, splits merged in the same launch.

Cache layout (attention/base.py draws it) and the key-tile loop are paged_attention.py's; the torch oracle is
kestrel/attention/torch_ref.py. On CPU tensors the kernels only run under Triton's interpreter.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.kernels.kv_store import effective_scales
from kestrel.kernels.triton.paged_attention import (LOG2E, _attend_kv, _attend_tile, _check_cache, _dot_in_fp32,
                                                    _dot_precision, _interpreted, _last_dim_contiguous,
                                                    _load_kv_tile)
from kestrel.kernels.triton.pdl import device_index, launch_options, pdl_wait, sm_count

MAX_DECODE_SPLITS = 32        # decode partial buffers are sized for this many splits
MIN_TOKENS_PER_SPLIT = 256    # of the table's capacity; sizes the grid only (run-time splits go down to one tile)


# ---------------------------------------------------------------------------------------------------------------
# decode: flash-decoding with split-K, merged in the same launch
# ---------------------------------------------------------------------------------------------------------------
#
# One launch, one program per (sequence, kv head, split). The query heads sharing that kv head ([BLOCK_H, D],
# padded to 16 rows so tl.dot can use tensor cores) attend to the split's slice of the context. The slice of split
# j is [j * per_split, (j + 1) * per_split) clipped to kv_len, with per_split computed on the device from kv_len,
# so the grid depends only on shapes (CUDA-graph safe) and splits past the end do nothing; the used splits always
# form a prefix of used_splits = cdiv(kv_len, per_split).
#   used_splits == 1: the lone program writes the final output directly.
#   used_splits  > 1: each program writes a normalised partial output and its log2-sum-exp into scratch
#         partial_out: [S, Hq, MAX_SPLITS, D] fp32      partial_lse: [S, Hq, MAX_SPLITS] fp32
#     then bumps counters[s, kv_head] (int32) with an acq_rel atomic; the program that sees used_splits - 1 is
#     the last, merges all used splits' partials and writes the output (_merge_splits: one round of loads) and
#     resets the counter to 0, so the scratch is ready for the next layer or graph replay.
#   kv_len == 0 (a padded row): split 0 writes zeros; no partials, no atomics.
# No program ever waits on another (the last one to finish does the merge), so there is no forward-progress
# hazard however the programs are scheduled; under the interpreter programs run in order and the last used split
# merges. Memory ordering: Triton issues a scalar atomic from one thread, so a barrier first puts all of the
# program's partial stores before its release; the merging program's acquire (then Triton's broadcast barrier)
# puts its loads after every other program's release. Those loads also go through L2 only (.cg): other SMs wrote
# the lines during this launch and they are read once, so skipping L1 costs nothing and does not lean on the
# acquire invalidating L1 for the threads that did not issue it.

@triton.jit
def _merge_splits(part_out_ptr, part_lse_ptr, out_ptr, seq, kv_head, used_splits,
                  stride_po_s, stride_po_h, stride_po_split, stride_pl_s, stride_pl_h, stride_os, stride_oh,
                  GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    """Stores into out the softmax-weighted sum of splits 0 .. used_splits - 1 of sequence seq's partials, for
    the GROUP query heads of kv_head.

    One head at a time: its log-sum-exps are scalar loads (the same value in every thread), so the weights need
    no reduction across threads and no layout change, and the split loop is a multiply-add per element. Every
    load is independent of the others, so the merge costs about one memory round trip. (Extracting each split's
    weights from a [16, S] tile over the attention tiles' padded rows took 680 shuffles and 67 CTA barriers after
    the atomic on the Qwen3-0.6B shapes.) Loads bypass L1 (.cg): other SMs wrote these lines during this launch
    (memory ordering note above).
    """
    head0 = kv_head * GROUP
    po_group = part_out_ptr + seq * stride_po_s + head0 * stride_po_h
    pl_group = part_lse_ptr + seq * stride_pl_s + head0 * stride_pl_h
    out_group = out_ptr + seq * stride_os + head0 * stride_oh
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    for g in tl.static_range(GROUP):
        pl = pl_group + g * stride_pl_h
        m = float("-inf")
        for sp in tl.static_range(BLOCK_S):
            m = tl.maximum(m, tl.load(pl + sp, mask=sp < used_splits, other=float("-inf"), cache_modifier=".cg"))
        acc = tl.zeros([BLOCK_D], tl.float32)
        total = 0.0
        for sp in tl.static_range(BLOCK_S):
            used = sp < used_splits
            weight = tl.exp2(tl.load(pl + sp, mask=used, other=float("-inf"), cache_modifier=".cg") - m)
            part = tl.load(po_group + g * stride_po_h + sp * stride_po_split + dims, mask=dim_mask & used,
                           other=0.0, cache_modifier=".cg")
            acc += weight * part
            total += weight
        tl.store(out_group + g * stride_oh + dims, (acc / total).to(out_group.dtype.element_ty), mask=dim_mask)


@triton.jit
def _decode_split_range(kv_len, split, num_splits, BLOCK_N: tl.constexpr):
    """Split `split`'s slice [start, end) of a kv_len-token context, and how many splits are used (a prefix)."""
    per_split = tl.maximum(tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N, BLOCK_N)
    used_splits = tl.cdiv(kv_len, per_split)   # 0 when kv_len == 0
    start = split * per_split
    end = tl.minimum(start + per_split, kv_len)
    return start, end, used_splits


@triton.jit
def _decode_split(
    q, seq, kv_head, split, kv_len, start, end, used_splits,
    k_cache_ptr, v_cache_ptr, block_table_ptr, out_ptr, part_out_ptr, part_lse_ptr, counter_ptr,
    scale_log2, v_scale,
    stride_kc_block, stride_kc_off, stride_kc_head,
    stride_vc_block, stride_vc_off, stride_vc_head,
    stride_bt,
    stride_os, stride_oh,
    stride_po_s, stride_po_h, stride_po_split,
    stride_pl_s, stride_pl_h,
    stride_cnt_s,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr, BLOCK_S: tl.constexpr, k_first, v_first,
):
    """The body of a decode program with a non-empty slice (start < end): q [BLOCK_H, BLOCK_D] (the GROUP heads
    of kv_head, rows past GROUP zero) attends to keys start .. end - 1; then the output, or the partial and the
    merge (comment above).
    k_first, v_first hold the slice's first tile as read before the PDL wait, every key but the newest (position
    kv_len - 1, written by the kernel just before this one); that row is read and put in now."""
    rows = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + rows
    row_mask = rows < GROUP
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    out_mask = row_mask[:, None] & dim_mask[None, :]
    out_ptrs = out_ptr + seq * stride_os + heads[:, None] * stride_oh + dims[None, :]
    row_pos = tl.zeros([BLOCK_H], tl.int32) + (kv_len - 1)   # the single query sees the whole context

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    table_row = block_table_ptr + seq * stride_bt
    k_base = k_cache_ptr + kv_head * stride_kc_head
    v_base = v_cache_ptr + kv_head * stride_vc_head
    newest = kv_len - 1   # in a tile of this slice only if the slice ends the context
    k_new, v_new = _load_kv_tile(start, newest, tl.minimum(end, newest + 1), table_row, k_base, v_base,
                                 stride_kc_block, stride_kc_off, stride_vc_block, stride_vc_off,
                                 dims, dim_mask, BLOCK_N, BLOCK_SIZE)
    is_newest = (start + tl.arange(0, BLOCK_N) == newest)[:, None]
    k_tile = tl.where(is_newest, k_new, k_first)
    v_tile = tl.where(is_newest, v_new, v_first)
    m_i, l_i, acc = _attend_kv(q, m_i, l_i, acc, k_tile, v_tile, start, end, row_pos, scale_log2,
                               BLOCK_N, DOT_FP32, DOT_PRECISION)
    first = start + BLOCK_N
    if INTERPRET:
        n0 = first
        while n0 < end:
            m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, n0, end, row_pos, table_row, k_base, v_base,
                                         stride_kc_block, stride_kc_off, stride_vc_block, stride_vc_off,
                                         dims, dim_mask, scale_log2, BLOCK_N, BLOCK_SIZE, DOT_FP32, DOT_PRECISION)
            n0 += BLOCK_N
    else:
        for n0 in range(first, end, BLOCK_N):
            m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, n0, end, row_pos, table_row, k_base, v_base,
                                         stride_kc_block, stride_kc_off, stride_vc_block, stride_vc_off,
                                         dims, dim_mask, scale_log2, BLOCK_N, BLOCK_SIZE, DOT_FP32, DOT_PRECISION)

    # v_scale (an FP8 cache's; 1.0 else) goes into each split's output: the merge is linear in them
    if used_splits == 1:   # the whole context in one program: no partials, no atomics
        tl.store(out_ptrs, (acc * (v_scale / l_i[:, None])).to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        po_base = part_out_ptr + seq * stride_po_s + heads[:, None] * stride_po_h
        pl_base = part_lse_ptr + seq * stride_pl_s + heads * stride_pl_h
        tl.store(po_base + split * stride_po_split + dims[None, :], acc * (v_scale / l_i[:, None]), mask=out_mask)
        tl.store(pl_base + split, m_i + tl.log2(l_i), mask=row_mask)
        # The last split program to finish merges. Every thread's partial stores must precede the (single-thread)
        # release atomic below.
        tl.debug_barrier()
        counter = counter_ptr + seq * stride_cnt_s + kv_head
        done = tl.atomic_add(counter, 1, sem="acq_rel")   # default scope: gpu
        if done == used_splits - 1:
            _merge_splits(part_out_ptr, part_lse_ptr, out_ptr, seq, kv_head, used_splits,
                          stride_po_s, stride_po_h, stride_po_split, stride_pl_s, stride_pl_h,
                          stride_os, stride_oh, GROUP, HEAD_DIM, BLOCK_D, BLOCK_S)
            # Every split has counted, so nothing else touches the counter in this launch; the next launch is
            # stream-ordered after this one.
            tl.store(counter, 0)


@triton.jit
def _decode_zero_output(out_ptr, seq, kv_head, stride_os, stride_oh,
                        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Output 0 for the GROUP heads of kv_head: a padded row (kv_len 0), written by its split 0."""
    rows = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + rows
    tl.store(out_ptr + seq * stride_os + heads[:, None] * stride_oh + dims[None, :],
             tl.zeros([BLOCK_H, BLOCK_D], tl.float32).to(out_ptr.dtype.element_ty),
             mask=(rows[:, None] < GROUP) & (dims[None, :] < HEAD_DIM))


@triton.jit
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, kv_lens_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    counter_ptr,
    scale_log2,                  # softmax scale * k_scale * log2(e)
    v_scale,                     # 1.0 but for an FP8 cache
    num_splits,
    stride_qs, stride_qh,
    stride_kc_block, stride_kc_off, stride_kc_head,
    stride_vc_block, stride_vc_off, stride_vc_head,
    stride_bt,
    stride_os, stride_oh,
    stride_po_s, stride_po_h, stride_po_split,
    stride_pl_s, stride_pl_h,
    stride_cnt_s,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr, BLOCK_S: tl.constexpr, USE_PDL: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # Before the wait, only what no kernel of this step writes: kv_lens and the block table (copied in before the
    # step) and the K/V of every earlier token; the newest token's K/V comes from the kernel before this one, so
    # the first tile is read without it (_decode_split puts it in after the wait). With 32-key tiles this took the
    # Qwen3-0.6B bs1 step from 0.758 to 0.714 ms on the H200.
    kv_len = tl.load(kv_lens_ptr + seq)
    start, end, used_splits = _decode_split_range(kv_len, split, num_splits, BLOCK_N)
    k_first, v_first = _load_kv_tile(start, start, tl.minimum(end, kv_len - 1),
                                     block_table_ptr + seq * stride_bt, k_cache_ptr + kv_head * stride_kc_head,
                                     v_cache_ptr + kv_head * stride_vc_head, stride_kc_block, stride_kc_off,
                                     stride_vc_block, stride_vc_off, tl.arange(0, BLOCK_D),
                                     tl.arange(0, BLOCK_D) < HEAD_DIM, BLOCK_N, BLOCK_SIZE)
    pdl_wait(USE_PDL)   # q, the newest K/V and the counters come from earlier kernels
    if start < end:
        rows = tl.arange(0, BLOCK_H)
        heads = kv_head * GROUP + rows
        dims = tl.arange(0, BLOCK_D)
        q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + dims[None, :],
                    mask=(rows[:, None] < GROUP) & (dims[None, :] < HEAD_DIM), other=0.0)
        if DOT_FP32:
            q = q.to(tl.float32)
        _decode_split(q, seq, kv_head, split, kv_len, start, end, used_splits,
                      k_cache_ptr, v_cache_ptr, block_table_ptr, out_ptr, part_out_ptr, part_lse_ptr, counter_ptr,
                      scale_log2, v_scale,
                      stride_kc_block, stride_kc_off, stride_kc_head,
                      stride_vc_block, stride_vc_off, stride_vc_head,
                      stride_bt, stride_os, stride_oh,
                      stride_po_s, stride_po_h, stride_po_split, stride_pl_s, stride_pl_h, stride_cnt_s,
                      GROUP, HEAD_DIM, BLOCK_H, BLOCK_D, BLOCK_N, BLOCK_SIZE, DOT_FP32, DOT_PRECISION,
                      INTERPRET, BLOCK_S, k_first, v_first)
    elif split == 0 and kv_len == 0:   # a padded row of a graph batch: output 0, counter untouched
        _decode_zero_output(out_ptr, seq, kv_head, stride_os, stride_oh, GROUP, HEAD_DIM, BLOCK_H, BLOCK_D)


def default_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    """Splits per sequence from shapes only (never from kv_lens), so a captured graph replays any lengths.

    Enough programs to fill the GPU about twice over, but no split shorter than MIN_TOKENS_PER_SPLIT of the
    table's capacity (max_context = max_blocks * block_size).
    """
    sms = sm_count(device_index(device)) if device.type == "cuda" else 8
    for_occupancy = triton.cdiv(2 * sms, max(num_seqs * num_kv_heads, 1))
    for_length = triton.cdiv(max_context, MIN_TOKENS_PER_SPLIT)
    return max(1, min(for_occupancy, for_length, MAX_DECODE_SPLITS))


DecodeScratch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]   # (partial_out, partial_lse, counters)


def alloc_decode_partials(max_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int,
                          device: torch.device) -> DecodeScratch:
    """Scratch for decode: partial_out [max_seqs, Hq, MAX_SPLITS, D] and partial_lse [max_seqs, Hq, MAX_SPLITS]
    fp32, and the split counters [max_seqs, Hkv] int32, which start at zero and every decode launch leaves at zero.
    """
    out = torch.empty(max_seqs, num_heads, MAX_DECODE_SPLITS, head_dim, dtype=torch.float32, device=device)
    lse = torch.empty(max_seqs, num_heads, MAX_DECODE_SPLITS, dtype=torch.float32, device=device)
    counters = torch.zeros(max_seqs, num_kv_heads, dtype=torch.int32, device=device)
    return out, lse, counters


def decode_attention(
    q: torch.Tensor,             # [S, Hq, D], one query token per sequence
    k_cache: torch.Tensor,       # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_table: torch.Tensor,   # [S, max_blocks] int32
    kv_lens: torch.Tensor,       # [S] int32, on the device; 0 for padded rows (their output is 0)
    scale: float,
    num_splits: int | None = None,
    partials: DecodeScratch | None = None,
    tiles: dict[str, int] | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Attention of each sequence's single query over its whole cached context; one launch, no host sync.
    k_scale, v_scale: an FP8 cache's (paged_attention.py; ignored for any other cache dtype).

    partials: scratch from alloc_decode_partials with at least S rows (pass static ones under CUDA graphs). Launches
    sharing it must be stream-ordered (the layers of a step are), since each one uses and then re-zeroes the
    counters. tiles: BLOCK_N, num_warps, num_stages for a compiled launch in place of _decode_tiles' (a caller with
    far wider heads than K/V attention's: kernels/triton/latent_decode.py); ignored under the interpreter.
    """
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    assert num_heads % num_kv_heads == 0, f"{num_heads} query heads do not group over {num_kv_heads} kv heads"
    _check_cache(k_cache, v_cache)
    q = _last_dim_contiguous(q)
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    num_splits, partials = decode_scratch(num_seqs, num_heads, num_kv_heads, head_dim, block_table, block_size,
                                          q.device, num_splits, partials)
    part_out, part_lse, counters = partials
    meta = decode_meta(q, num_heads // num_kv_heads, head_dim, num_splits, tiles)
    pdl = launch_options(q.device)
    k_scale, v_scale = effective_scales(k_cache, k_scale, v_scale)
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_table, kv_lens, out, part_out, part_lse, counters,
        scale * k_scale * LOG2E, v_scale, num_splits,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0),
        out.stride(0), out.stride(1),
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        counters.stride(0),
        BLOCK_SIZE=block_size, **meta, **pdl,
    )
    return out


def decode_scratch(num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int, block_table: torch.Tensor,
                   block_size: int, device: torch.device, num_splits: int | None,
                   partials: DecodeScratch | None) -> tuple[int, DecodeScratch]:
    """The launch's split count (default_num_splits when None) and scratch (allocated when None), checked."""
    if num_splits is None:
        num_splits = default_num_splits(num_seqs, num_kv_heads, block_table.shape[1] * block_size, device)
    assert 1 <= num_splits <= MAX_DECODE_SPLITS, f"num_splits {num_splits} not in [1, {MAX_DECODE_SPLITS}]"
    if partials is None:
        partials = alloc_decode_partials(num_seqs, num_heads, num_kv_heads, head_dim, device)
    part_out, part_lse, counters = partials
    assert part_out.shape[0] >= num_seqs and part_out.shape[1:] == (num_heads, MAX_DECODE_SPLITS, head_dim)
    assert counters.dtype == torch.int32 and counters.shape[0] >= num_seqs and counters.shape[1] == num_kv_heads \
        and counters.stride(1) == 1, f"counters {tuple(counters.shape)} {counters.dtype} do not fit"
    return num_splits, partials


def decode_meta(q: torch.Tensor, group: int, head_dim: int, num_splits: int,
                tiles: dict[str, int] | None = None) -> dict:
    """Compile-time parameters and launch options shared by every decode-kernel launch (q: any tensor of the
    query dtype)."""
    tiles = _decode_tiles(q) if tiles is None or _interpreted() else tiles
    return dict(
        GROUP=group, HEAD_DIM=head_dim, BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_N=tiles["BLOCK_N"],
        DOT_FP32=_dot_in_fp32(q), DOT_PRECISION=_dot_precision(q), INTERPRET=_interpreted(),
        BLOCK_S=triton.next_power_of_2(num_splits),
        num_warps=tiles["num_warps"], num_stages=tiles["num_stages"],
    )


def _decode_tiles(q: torch.Tensor) -> dict[str, int]:
    if _interpreted():  # small tiles so the tests' tiny contexts still span several tiles and splits
        return {"BLOCK_N": 16, "num_warps": 1, "num_stages": 1}
    # The key tile is also the shortest split (_decode_split_range), and at bs1 more, shorter splits measured
    # faster: splits of >= 256 or 512 keys cost +14%, 128-key tiles +10%; 32-key tiles beat 64 by 1.6% alone and
    # by 5.8% with the prefetch before the PDL wait; 16-key tiles −0.4% (noise), 2 warps +8%.
    return {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
