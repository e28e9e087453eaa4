"""Fused mixture-of-experts: the experts' gate|up GEMM with SiLU-mul, and their down GEMM scaled by the router
weight, each one launch over every expert; the torch reference is layers/moe.py's `fused_experts_torch` and the
wrapper takes the same arguments (LayerOps.fused_moe).

The (token, slot) rows are grouped by expert and each expert's run padded to a multiple of BLOCK_M, so every
BLOCK_M tile of rows belongs to one expert and multiplies one weight matrix (`align_by_expert`, torch ops only:
no host sync, sizes fixed by T, k and E, so it can sit in a CUDA graph):

    flat row r = token r // k, slot r % k                              (T k rows; sentinel T k = padding)
    sorted_rows: | e0 rows, pad to BLOCK_M | e1 rows, pad | ... | e3 rows, pad | unused tiles (all sentinel) |
    tile_expert: | 0 0              | 1 ...       | ... | 3 ...       | -1 -1 ...                             |
    capacity: T k + E (BLOCK_M - 1) rounded up to BLOCK_M, the most any routing can need

    kernel 1, grid (tiles, I / BLOCK_N): inter[r] = silu(x[token] @ W_gate[e].T) * (x[token] @ W_up[e].T)
    kernel 2, grid (tiles, H / BLOCK_N): rows_out[r] = weight[r] * (inter[r] @ W_down[e].T)          (float32)
    out[t] = sum over slots of rows_out[t k + slot]                    (torch; cast to x's dtype)

An expert with no tokens gets no tile; a tile of an unused expert id (-1) returns at once.

Decode batches (T k <= ROWS_PATH_MAX rows) skip the alignment (`path="rows"`): two launches, no torch op after
them (bs1, top-8 of 128 experts: 8 of 121 tiles would hold a row):

    gate|up, grid (T k, I / up_n): row r = (token, slot), its expert e = ids[r]
        program: W13[e] rows [c, c + up_n) (gate) and [I + c, I + c + up_n) (up), each streamed along H
                 [up_n, up_k] tiles, products kept in [up_n, up_k] float32, summed across lanes once at the end
        inter[r, c:c+up_n] = silu(gate) * up                         (the reference's roundings, x's dtype)
    down + slot sum, grid (T, H / down_n): all k slots of one token in one program
        program: [k, down_n, down_k] tiles = W2[ids[t, s]] rows [c, c + down_n) for every slot s, along I
        out[t, c:c+down_n] = sum_s weight[t, s] * (inter[t k + s] @ W2[e_s].T)     (float32 sum, one rounding)

So the per-(token, slot) float32 rows, the torch sum over the slots and its cast back (reduce_kernel and
bfloat16_copy, two launches a layer in the s22 profile) are gone, and the output is written once in x's dtype.
Nothing reads back to the host: CUDA-graph capturable. Two tokens that pick the same expert read its weights twice
(mostly from L2); past ROWS_PATH_MAX rows the tiles, which read each expert once, take over. Both paths round what the reference rounds, where it rounds it.

The tiles path's compiled kernels multiply bf16 / fp16 operands on the tensor cores with float32 accumulation
(float32 models: exact "ieee" dots, the parity path); under Triton's interpreter bf16 operands are upcast first,
since its bf16 dot is wrong (tests/test_triton_kernels.py). The rows path multiplies and sums in float32 (CUDA
cores: one row has nothing for a tensor core to share).
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import triton
import triton.language as tl

from kestrel.kernels.triton.pdl import launch_options, pdl_wait

BLOCK_M = 16
ROWS_PATH_MAX = 64   # (token, slot) rows up to which the per-row matrix-vector path runs (bs 8 at top-8)


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_rows [capacity] int32, tile_expert [capacity / block_m] int32), drawn in the module docstring."""
    flat = topk_ids.reshape(-1).long()
    num_rows = flat.numel()
    # not torch.bincount: on CUDA it reads the largest id back to the host to size its output, which breaks a CUDA
    # graph capture (and stalls every eager step); a scatter into E counters is sized by E alone
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)                     # rows by expert, in row order within one
    by_expert = flat[order]
    rank = torch.arange(num_rows, device=flat.device) - (torch.cumsum(counts, 0) - counts)[by_expert]
    capacity = -(-(num_rows + num_experts * (block_m - 1)) // block_m) * block_m
    sorted_rows = torch.full((capacity,), num_rows, dtype=torch.int32, device=flat.device)
    sorted_rows[(ends - padded)[by_expert] + rank] = order.to(torch.int32)
    tile_start = torch.arange(0, capacity, block_m, device=flat.device)
    tile_expert = torch.searchsorted(ends, tile_start, right=True)   # first expert whose run ends past the tile
    tile_expert = torch.where(tile_expert < num_experts, tile_expert, -1).to(torch.int32)
    return sorted_rows, tile_expert


@triton.jit
def _moe_gate_up_kernel(x_ptr, w13_ptr, sorted_rows_ptr, tile_expert_ptr, inter_ptr, num_rows,
                        stride_x, stride_we, stride_wn, stride_i,
                        TOPK: tl.constexpr, H: tl.constexpr, I: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr):
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile)
    if expert < 0:   # a tile past the last expert's run: no rows, nothing to write
        return
    used = expert >= 0
    expert = expert.to(tl.int64)
    rows = tl.load(sorted_rows_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = (rows < num_rows) & used
    tokens = (rows // TOPK).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < I
    gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    w_base = w13_ptr + expert * stride_we
    for k0 in range(0, H, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < H
        a = tl.load(x_ptr + tokens[:, None] * stride_x + ks[None, :], mask=valid[:, None] & k_ok[None, :],
                    other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        wg = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None], mask=w_mask, other=0.0)
        wu = tl.load(w_base + (cols[None, :] + I) * stride_wn + ks[:, None], mask=w_mask, other=0.0)
        if DOT_FP32:
            a, wg, wu = a.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
        gate += tl.dot(a, wg, input_precision=DOT_PRECISION)
        up += tl.dot(a, wu, input_precision=DOT_PRECISION)
    # as the reference: silu(gate) rounded to the model dtype, then times up
    act = (gate * tl.sigmoid(gate)).to(inter_ptr.dtype.element_ty).to(tl.float32) * \
        up.to(inter_ptr.dtype.element_ty).to(tl.float32)
    tl.store(inter_ptr + rows[:, None].to(tl.int64) * stride_i + cols[None, :],
             act.to(inter_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _moe_down_kernel(inter_ptr, w2_ptr, sorted_rows_ptr, tile_expert_ptr, weights_ptr, out_ptr, num_rows,
                     stride_i, stride_we, stride_wn, stride_o,
                     H: tl.constexpr, I: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr):
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile)
    if expert < 0:
        return
    used = expert >= 0
    expert = expert.to(tl.int64)
    rows = tl.load(sorted_rows_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = (rows < num_rows) & used
    rows64 = rows.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < H
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    w_base = w2_ptr + expert * stride_we
    for k0 in range(0, I, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < I
        a = tl.load(inter_ptr + rows64[:, None] * stride_i + ks[None, :], mask=valid[:, None] & k_ok[None, :],
                    other=0.0)
        w = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None], mask=k_ok[:, None] & col_ok[None, :],
                    other=0.0)
        if DOT_FP32:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc += tl.dot(a, w, input_precision=DOT_PRECISION)
    # the expert's output in the model dtype (as the reference's F.linear), then weighed in float32
    acc = acc.to(inter_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weights_ptr + rows64, mask=valid, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows64[:, None] * stride_o + cols[None, :], acc * weight[:, None],
             mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _rounded(v, dtype: tl.constexpr, RNE_BF16: tl.constexpr):
    """float32 v rounded to dtype (the model's), returned in float32. RNE_BF16 (Triton's interpreter, bf16): its
    float32 -> bf16 cast truncates where the GPU's rounds to nearest even, a bias that grows with every rounding
    the reference makes; the bit form below is the GPU's rounding (finite values), used only there."""
    if RNE_BF16:
        bits = v.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        out = bits.to(tl.float32, bitcast=True)
    else:
        out = v.to(dtype).to(tl.float32)
    return out


@triton.jit
def _moe_gate_up_rows_kernel(x_ptr, w13_ptr, ids_ptr, inter_ptr, stride_x, stride_we, stride_wn, stride_i,
                             TOPK: tl.constexpr, H: tl.constexpr, I: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, RNE_BF16: tl.constexpr,
                             USE_PDL: tl.constexpr):
    """inter[row, cols] for one (token, slot) row: its expert's BLOCK_N gate rows and BLOCK_N up rows against
    x[token], each weight row streamed contiguously along H.

    The products accumulate in [BLOCK_N, BLOCK_K] float32 registers and are summed across lanes once, after the
    last step: a per-step tl.sum would put a cross-lane reduction between one step's loads and the next's, and
    with the steps unrolled (tl.static_range) and independent, every step's loads can be issued up front.
    Under PDL it waits first: which weights to read is the routing's output."""
    pdl_wait(USE_PDL)
    row = tl.program_id(0)
    token = (row // TOPK).to(tl.int64)
    expert = tl.load(ids_ptr + row).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < I
    gate = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    w_gate = w13_ptr + expert * stride_we + cols[:, None].to(tl.int64) * stride_wn
    w_up = w_gate + I * stride_wn
    for k0 in tl.static_range(0, H, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < H
        w_mask = col_ok[:, None] & k_ok[None, :]
        wg = tl.load(w_gate + ks[None, :], mask=w_mask, other=0.0)
        wu = tl.load(w_up + ks[None, :], mask=w_mask, other=0.0)
        a = tl.load(x_ptr + token * stride_x + ks, mask=k_ok, other=0.0).to(tl.float32)
        gate += wg.to(tl.float32) * a[None, :]
        up += wu.to(tl.float32) * a[None, :]
    dtype = inter_ptr.dtype.element_ty
    # as the reference: F.linear's gate and up rounded to the model dtype, silu(gate) rounded, times up, rounded
    g = _rounded(tl.sum(gate, axis=1), dtype, RNE_BF16)
    u = _rounded(tl.sum(up, axis=1), dtype, RNE_BF16)
    act = _rounded(_rounded(g * tl.sigmoid(g), dtype, RNE_BF16) * u, dtype, RNE_BF16)
    tl.store(inter_ptr + row.to(tl.int64) * stride_i + cols, act.to(dtype), mask=col_ok)


@triton.jit
def _moe_down_sum_rows_kernel(inter_ptr, w2_ptr, ids_ptr, weights_ptr, out_ptr, stride_i, stride_we, stride_wn,
                              stride_o, TOPK: tl.constexpr, H: tl.constexpr, I: tl.constexpr,
                              BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                              RNE_BF16: tl.constexpr, USE_PDL: tl.constexpr):
    """out[token, cols] = sum over the token's k slots of weight[slot] * (inter[row] @ W_down[expert].T)[cols].

    One program holds the token's k experts at once, a [BLOCK_S (slots), BLOCK_N (columns), BLOCK_K] tile a step:
    k x BLOCK_N weight rows streamed along I together, so all k experts' loads are in flight at the same time.
    Roundings as the reference's: each expert's output in the model dtype (F.linear), weighed and summed over the
    slots in float32, one rounding to the model dtype at the end (float32 sums in slot order, not expert order:
    the two differ by float32 rounding).

    Under PDL the first step's weight tile is read before the wait, while the gate|up kernel finishes (pdl.py's
    rule allows weights only; the expert ids are read there too, and are final: the routing that writes them is
    launched in plain stream order, so the gate|up kernel starts after it completed, and this kernel starts after
    every gate|up program passed its own wait). inter, the gate|up kernel's output, is read after the wait."""
    token = tl.program_id(0).to(tl.int64)
    slots = tl.arange(0, BLOCK_S)
    slot_ok = slots < TOPK
    rows = token * TOPK + slots                                                       # [BLOCK_S]
    experts = tl.load(ids_ptr + rows, mask=slot_ok, other=0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < H
    w_rows = w2_ptr + experts[:, None, None] * stride_we + cols[None, :, None].to(tl.int64) * stride_wn
    a_rows = inter_ptr + rows[:, None] * stride_i                                     # [BLOCK_S, 1]
    row_ok = slot_ok[:, None, None] & col_ok[None, :, None]
    first = tl.load(w_rows + tl.arange(0, BLOCK_K)[None, None, :],
                    mask=row_ok & (tl.arange(0, BLOCK_K) < I)[None, None, :], other=0.0)
    pdl_wait(USE_PDL)
    acc = tl.zeros([BLOCK_S, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in tl.static_range(0, I, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < I
        if k0 == 0:
            w = first
        else:
            w = tl.load(w_rows + ks[None, None, :], mask=row_ok & k_ok[None, None, :], other=0.0)
        a = tl.load(a_rows + ks[None, :], mask=slot_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += w.to(tl.float32) * a[:, None, :]
    dtype = inter_ptr.dtype.element_ty
    y = _rounded(tl.sum(acc, axis=2), dtype, RNE_BF16)                                # [BLOCK_S, BLOCK_N]
    weight = tl.load(weights_ptr + rows, mask=slot_ok, other=0.0).to(tl.float32)
    out = _rounded(tl.sum(y * weight[:, None], axis=0), dtype, RNE_BF16)              # padded slots weigh 0
    tl.store(out_ptr + token * stride_o + cols, out.to(dtype), mask=col_ok)


def fused_experts_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                         topk_weights: torch.Tensor, silu_and_mul: Callable | None = None,
                         path: str | None = None, tiles: MoeTiles | None = None,
                         row_config: RowTiles | None = None) -> torch.Tensor:
    """fused_experts_torch's contract in two launches: x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_ids [T, k],
    topk_weights [T, k] -> [T, H] in x's dtype. silu_and_mul is accepted for the common signature and unused
    (the first kernel applies it). path: "rows" | "tiles" (None: rows up to ROWS_PATH_MAX (token, slot) rows);
    tiles: the tiles path's launch shape (None: `moe_tiles`, the tuned table for this shape and device, by T);
    row_config: the rows path's (None: `row_tiles`)."""
    num_tokens, topk = topk_ids.shape
    num_experts, two_i, hidden = w13.shape
    inter_size = two_i // 2
    num_rows = num_tokens * topk
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    path = path or ("rows" if num_rows <= ROWS_PATH_MAX else "tiles")
    if path == "rows":
        return _experts_by_rows(x, w13, w2, topk_ids, topk_weights, row_config)
    if path != "tiles":
        raise ValueError(f"path {path!r}: expected rows or tiles")
    t = tiles or moe_tiles(num_tokens, num_experts, inter_size, hidden, topk, x.device)
    sorted_rows, tile_expert = align_by_expert(topk_ids, num_experts, t.block_m)
    grid_tiles = tile_expert.numel()
    dots = dict(DOT_FP32=_interpreted() and x.dtype == torch.bfloat16,
                DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32")
    launch = dict(num_warps=t.num_warps, num_stages=t.num_stages)
    inter = torch.empty(num_rows, inter_size, dtype=x.dtype, device=x.device)
    _moe_gate_up_kernel[(grid_tiles, triton.cdiv(inter_size, t.block_n))](
        x, w13, sorted_rows, tile_expert, inter, num_rows, x.stride(0), w13.stride(0), w13.stride(1),
        inter.stride(0), TOPK=topk, H=hidden, I=inter_size, BLOCK_M=t.block_m, BLOCK_N=t.block_n,
        BLOCK_K=t.block_k, **dots, **launch)
    rows_out = torch.empty(num_rows, hidden, dtype=torch.float32, device=x.device)
    weights = topk_weights.reshape(-1).float().contiguous()
    _moe_down_kernel[(grid_tiles, triton.cdiv(hidden, t.down_block_n))](
        inter, w2, sorted_rows, tile_expert, weights, rows_out, num_rows, inter.stride(0), w2.stride(0),
        w2.stride(1), rows_out.stride(0), H=hidden, I=inter_size, BLOCK_M=t.block_m, BLOCK_N=t.down_block_n,
        BLOCK_K=t.down_block_k, **dots, **launch)
    return rows_out.view(num_tokens, topk, hidden).sum(dim=1).to(x.dtype)


def _experts_by_rows(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                     topk_weights: torch.Tensor, tiles: RowTiles | None = None) -> torch.Tensor:
    """The decode path (module docstring): no alignment; a matrix-vector product per (token, slot) row, then one
    per (token, column block) over the token's k experts that writes the weighted sum in x's dtype."""
    num_tokens, topk = topk_ids.shape
    _, two_i, hidden = w13.shape
    inter_size = two_i // 2
    num_rows = num_tokens * topk
    out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out
    ids = topk_ids.reshape(-1).contiguous()
    t = tiles or row_tiles(topk, hidden, inter_size)
    rne = _interpreted() and x.dtype == torch.bfloat16
    inter = torch.empty(num_rows, inter_size, dtype=x.dtype, device=x.device)
    _moe_gate_up_rows_kernel[(num_rows, triton.cdiv(inter_size, t.up_n))](
        x, w13, ids, inter, x.stride(0), w13.stride(0), w13.stride(1), inter.stride(0), TOPK=topk, H=hidden,
        I=inter_size, BLOCK_N=t.up_n, BLOCK_K=t.up_k, RNE_BF16=rne, num_warps=t.up_warps, **launch_options(x.device))
    weights = topk_weights.reshape(-1)
    if weights.dtype != torch.float32 or not weights.is_contiguous():   # the router's are both: no copy
        weights = weights.float().contiguous()
    _moe_down_sum_rows_kernel[(num_tokens, triton.cdiv(hidden, t.down_n))](
        inter, w2, ids, weights, out, inter.stride(0), w2.stride(0), w2.stride(1), out.stride(0), TOPK=topk,
        H=hidden, I=inter_size, BLOCK_S=max(2, triton.next_power_of_2(topk)), BLOCK_N=t.down_n,
        BLOCK_K=t.down_k, RNE_BF16=rne, num_warps=t.down_warps, **launch_options(x.device))
    return out


@dataclass(frozen=True)
class RowTiles:
    """The rows path's launch shapes: gate|up programs own up_n gate rows + up_n up rows of one expert and walk H
    in up_k steps; down programs own down_n output columns of one token and walk I in down_k steps, all k slots
    at once (a [k, down_n, down_k] tile a step)."""
    up_n: int
    up_k: int
    up_warps: int
    down_n: int
    down_k: int
    down_warps: int


ROW_TILE_ELEMENTS = 16384   # weight elements a program loads per step (32 KB in bf16): its whole slice at bs1


def row_tiles(topk: int, hidden: int, inter: int) -> RowTiles:
    """Compiled: gemv.py's lesson for bs1 weight streams (whole-slice tiles, ~2+ programs an SM, one lane sum at
    the end) applied to the experts. Qwen3-30B-A3B bs1 (8 rows, H 2048, I 768):

        gate|up  [4 + 4 rows, 2048] in one step, 8 warps: 8 x 192 = 1536 programs of 32 KB (~12 an SM)
        down     [8 slots, 4 cols, 256] x 3 steps, 8 warps: 512 programs of 48 KB (~4 an SM)

    (the s22 profile's 16-column, 256-wide per-step-summed programs streamed gate|up at ~1.5 TB/s). Not yet timed:
    fused_experts_triton(row_config=) overrides it (tests/gpu/test_moe_gpu.py's rows sweep times a few).
    Interpreted: small, so the tests' shapes span several blocks and steps."""
    if _interpreted():
        return RowTiles(up_n=4, up_k=16, up_warps=4, down_n=8, down_k=16, down_warps=4)
    up_n = 4
    up_k = min(triton.next_power_of_2(hidden), ROW_TILE_ELEMENTS // (2 * up_n))
    down_n = 4
    slots = max(2, triton.next_power_of_2(topk))
    # ~8192 weight elements a step over the k slots (top-2 Mixtral: 1024-wide steps, top-8: 256), which keeps
    # the fully unrolled K loops short: I / down_k and H / up_k steps (Mixtral's I 14336: 14; DeepSeek's H 7168: 4)
    down_k = min(triton.next_power_of_2(inter), max(64, 8192 // (slots * down_n)))
    return RowTiles(up_n=up_n, up_k=up_k, up_warps=8 if 2 * up_n * up_k > 8192 else 4,
                    down_n=down_n, down_k=down_k, down_warps=8 if slots * down_n * down_k > 4096 else 4)


@dataclass(frozen=True)
class MoeTiles:
    """The tiles path's launch shape: BLOCK_M rows of one expert a program (the alignment pads each expert's run
    to it), BLOCK_N x BLOCK_K weight tiles for gate|up and down_block_n x down_block_k for down."""
    block_m: int = 16
    block_n: int = 64
    block_k: int = 128
    down_block_n: int = 64
    down_block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3


DEFAULT_TILES = MoeTiles()
CONFIG_DIR = Path(__file__).with_name("moe_configs")


def config_file_name(num_experts: int, inter: int, hidden: int, topk: int, device_name: str) -> str:
    """The tuned table's file for one expert shape on one GPU model (vLLM's per-(E, N, device) naming, with H and
    k beside: Kestrel's kernels tile H in down)."""
    return f"E={num_experts},N={inter},H={hidden},k={topk},device={device_name.replace(' ', '_')}.json"


@functools.cache
def tuned_table(name: str) -> tuple[tuple[int, MoeTiles], ...]:
    """((tokens, tiles), ...) from moe_configs/NAME, sorted by tokens; () when no table was tuned for it."""
    path = CONFIG_DIR / name
    if not path.is_file():
        return ()
    data = json.loads(path.read_text())
    return tuple(sorted((int(t), MoeTiles(**cfg)) for t, cfg in data["configs"].items()))


def moe_tiles(num_tokens: int, num_experts: int, inter: int, hidden: int, topk: int,
              device: torch.device) -> MoeTiles:
    """The tuned tiles for the batch bucket nearest num_tokens (benchmarks/moe_tune.py writes the tables, one per
    expert shape and GPU model, into moe_configs/); DEFAULT_TILES without a table: 16 x 64 x 128, vLLM's untuned
    choice at these expert widths. Chosen at capture time for a graph's batch size, so a replay never looks up.
    Interpreted: small tiles so tests' small shapes span several."""
    if _interpreted():
        return MoeTiles(block_m=16, block_n=32, block_k=32, down_block_n=32, down_block_k=32)
    if device.type != "cuda":
        return DEFAULT_TILES
    return nearest(tuned_table(config_file_name(num_experts, inter, hidden, topk,
                                                torch.cuda.get_device_name(device))), num_tokens)


def nearest(table: tuple[tuple[int, MoeTiles], ...], num_tokens: int) -> MoeTiles:
    """The entry tuned for the token count nearest num_tokens (the smaller on a tie); DEFAULT_TILES if none."""
    if not table:
        return DEFAULT_TILES
    return min(table, key=lambda entry: (abs(entry[0] - num_tokens), entry[0]))[1]


def _interpreted() -> bool:
    return bool(triton.knobs.runtime.interpret)
