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

Block-FP8 experts (layers/moe_fp8.py) run both paths with FP8 weights and their bn x bk tile scales, two ways:

    W8A16 (FP8, default)    each weight tile widened to x's dtype with its scale as it is read; bf16 tensor cores
    W8A8  (FP8 + QUANT_X)   KESTREL_FP8_MOE=w8a8: x (gate|up) and inter (down) quantized to E4M3 per token and
                            per bk-column group inside the K loop (tiles: BLOCK_K = bk, one group a step):
        acc[m, n] += dot_e4m3(q[m, k0:k0+bk], w8[k0:k0+bk, n]) * (x_scale[m, k0 / bk] * w_scale[n / bn, k0 / bk])
    In the loop, not a pre-pass (vLLM quantizes x and inter in separate launches first): no extra launch or HBM
    round trip of the activations, nothing new for a CUDA graph; each N-program recomputes its rows' group maxima
    (a [BLOCK_M, bk] max in registers beside a [BLOCK_M, bk] x [bk, BLOCK_N] dot), as fp8_block_gemm.py's W8A8 does.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch
import triton
import triton.language as tl

from kestrel.kernels.triton.fp8_block_gemm import ACT_TINY, FP8_MAX, _round_to_e4m3
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
                        DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
                        s_ptr=None, stride_se=0, stride_sn=0, FP8: tl.constexpr = False, SCALE_BN: tl.constexpr = 1,
                        SCALE_BK: tl.constexpr = 1, RNE_BF16: tl.constexpr = False, QUANT_X: tl.constexpr = False,
                        EMULATE_FP8: tl.constexpr = False):
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
        if FP8:   # BLOCK_K divides SCALE_BK: one scale column this step; up's row tiles follow gate's
            s_base = s_ptr + expert * stride_se + k0 // SCALE_BK
            sg = tl.load(s_base + (cols // SCALE_BN) * stride_sn, mask=col_ok, other=0.0)
            su = tl.load(s_base + (tl.cdiv(I, SCALE_BN) + cols // SCALE_BN) * stride_sn, mask=col_ok, other=0.0)
            if QUANT_X:   # W8A8: BLOCK_K == SCALE_BK, so this step's columns of x are one activation group
                aq, sx = _quantize_rows(a, EMULATE_FP8)
                gate += _dot_e4m3(aq, wg, EMULATE_FP8) * (sx[:, None] * sg[None, :])
                up += _dot_e4m3(aq, wu, EMULATE_FP8) * (sx[:, None] * su[None, :])
            else:
                wg = _dequant(wg, sg[None, :], x_ptr.dtype.element_ty, RNE_BF16)
                wu = _dequant(wu, su[None, :], x_ptr.dtype.element_ty, RNE_BF16)
        if not QUANT_X:
            if DOT_FP32:
                a, wg, wu = a.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
            gate += tl.dot(a, wg, input_precision=DOT_PRECISION)
            up += tl.dot(a, wu, input_precision=DOT_PRECISION)
    # as the reference: F.linear's gate and up rounded to the model dtype, silu(gate) rounded, times up, rounded
    dtype = inter_ptr.dtype.element_ty
    g = _rounded(gate, dtype, RNE_BF16)
    act = _rounded(_rounded(g * tl.sigmoid(g), dtype, RNE_BF16) * _rounded(up, dtype, RNE_BF16), dtype, RNE_BF16)
    tl.store(inter_ptr + rows[:, None].to(tl.int64) * stride_i + cols[None, :],
             act.to(inter_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _moe_down_kernel(inter_ptr, w2_ptr, sorted_rows_ptr, tile_expert_ptr, weights_ptr, out_ptr, num_rows,
                     stride_i, stride_we, stride_wn, stride_o,
                     H: tl.constexpr, I: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
                     s_ptr=None, stride_se=0, stride_sn=0, FP8: tl.constexpr = False, SCALE_BN: tl.constexpr = 1,
                     SCALE_BK: tl.constexpr = 1, RNE_BF16: tl.constexpr = False, QUANT_X: tl.constexpr = False,
                     EMULATE_FP8: tl.constexpr = False):
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
        if FP8:
            sw = tl.load(s_ptr + expert * stride_se + (cols // SCALE_BN) * stride_sn + k0 // SCALE_BK,
                         mask=col_ok, other=0.0)
            if QUANT_X:   # W8A8: this step's columns of inter are one activation group
                aq, sx = _quantize_rows(a, EMULATE_FP8)
                acc += _dot_e4m3(aq, w, EMULATE_FP8) * (sx[:, None] * sw[None, :])
            else:
                w = _dequant(w, sw[None, :], inter_ptr.dtype.element_ty, RNE_BF16)
        if not QUANT_X:
            if DOT_FP32:
                a, w = a.to(tl.float32), w.to(tl.float32)
            acc += tl.dot(a, w, input_precision=DOT_PRECISION)
    # the expert's output in the model dtype (as the reference's F.linear), then weighed in float32
    acc = _rounded(acc, inter_ptr.dtype.element_ty, RNE_BF16)
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
def _dequant(w8, scale, dtype: tl.constexpr, RNE_BF16: tl.constexpr):
    """FP8 weights times their tile's scale in float32, rounded once to dtype: exactly the reference's
    dequantize(...).to(dtype) (layers/moe_fp8.py), so both multiply the same weights."""
    return _rounded(w8.to(tl.float32) * scale, dtype, RNE_BF16).to(dtype)


@triton.jit
def _quantize_rows(a, EMULATE_FP8: tl.constexpr):
    """W8A8, tiles kernels: a [BLOCK_M, BLOCK_K] (one activation group of each row) -> (the E4M3 values in
    float32, scale [BLOCK_M]), a ~ q * scale; kernels/fp8_quant.py's quantize_activation_groups, op for op."""
    af = a.to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(af), axis=1), ACT_TINY) / FP8_MAX
    return tl.clamp(af / scale[:, None], -FP8_MAX, FP8_MAX), scale


@triton.jit
def _dot_e4m3(q, w8, EMULATE_FP8: tl.constexpr):
    """q [M, K] (float32 holding values to round to E4M3) @ w8 [K, N] (float8_e4m3fn) in float32: FP8 x FP8 on
    the tensor cores (wgmma e4m3 on Hopper); Triton's interpreter: the same E4M3 values (_round_to_e4m3: its own
    cast drops a rounding carry) multiplied exactly in float32."""
    if EMULATE_FP8:
        out = tl.dot(_round_to_e4m3(q), w8.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(q.to(tl.float8e4nv), w8)
    return out


@triton.jit
def _quantize_groups(a, BLOCK_K: tl.constexpr, GROUP: tl.constexpr, EMULATE_FP8: tl.constexpr):
    """W8A8, rows kernels: a [R, BLOCK_K] float32, GROUP | BLOCK_K -> (its E4M3 values in float32, each element's
    group scale [R, BLOCK_K]): every GROUP-column run of a row quantized as quantize_activation_groups does."""
    groups = tl.reshape(tl.abs(a), [a.shape[0], BLOCK_K // GROUP, GROUP])
    scale = tl.maximum(tl.max(groups, axis=2), ACT_TINY) / FP8_MAX                          # [R, BLOCK_K / GROUP]
    full = tl.reshape(tl.broadcast_to(scale[:, :, None], [a.shape[0], BLOCK_K // GROUP, GROUP]),
                      [a.shape[0], BLOCK_K])
    q = tl.clamp(a / full, -FP8_MAX, FP8_MAX)
    if EMULATE_FP8:
        q = _round_to_e4m3(q)
    else:
        q = q.to(tl.float8e4nv).to(tl.float32)
    return q, full


@triton.jit
def _moe_gate_up_rows_kernel(x_ptr, w13_ptr, ids_ptr, inter_ptr, stride_x, stride_we, stride_wn, stride_i,
                             TOPK: tl.constexpr, H: tl.constexpr, I: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, RNE_BF16: tl.constexpr,
                             USE_PDL: tl.constexpr, s_ptr=None, stride_se=0, stride_sn=0,
                             FP8: tl.constexpr = False, SCALE_BN: tl.constexpr = 1, SCALE_BK: tl.constexpr = 1,
                             QUANT_X: tl.constexpr = False, EMULATE_FP8: tl.constexpr = False):
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
        if FP8:   # a step may span several scale columns: each column's tile scale
            s_at = s_ptr + expert * stride_se + (ks // SCALE_BK)[None, :]
            if SCALE_BN % BLOCK_N == 0:   # the program's rows lie in one row tile: one [1, BLOCK_K] scale row
                n_tile = (tl.program_id(1) * BLOCK_N) // SCALE_BN
                sg = tl.load(s_at + n_tile * stride_sn, mask=k_ok[None, :], other=0.0)
                su = tl.load(s_at + (tl.cdiv(I, SCALE_BN) + n_tile) * stride_sn, mask=k_ok[None, :], other=0.0)
            else:   # each element's (row tile, column tile)
                sg = tl.load(s_at + (cols // SCALE_BN)[:, None] * stride_sn, mask=w_mask, other=0.0)
                su = tl.load(s_at + (tl.cdiv(I, SCALE_BN) + cols // SCALE_BN)[:, None] * stride_sn, mask=w_mask,
                             other=0.0)
            if not QUANT_X:
                wg = _dequant(wg, sg, x_ptr.dtype.element_ty, RNE_BF16)
                wu = _dequant(wu, su, x_ptr.dtype.element_ty, RNE_BF16)
        a = tl.load(x_ptr + token * stride_x + ks, mask=k_ok, other=0.0).to(tl.float32)
        if QUANT_X:   # W8A8: SCALE_BK | BLOCK_K, x's groups quantized here; each product scaled by both scales
            aq, sx = _quantize_groups(a[None, :], BLOCK_K, SCALE_BK, EMULATE_FP8)             # [1, BLOCK_K]
            gate += wg.to(tl.float32) * aq * (sg * sx)
            up += wu.to(tl.float32) * aq * (su * sx)
        else:
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
                              RNE_BF16: tl.constexpr, USE_PDL: tl.constexpr, s_ptr=None, stride_se=0,
                              stride_sn=0, FP8: tl.constexpr = False, SCALE_BN: tl.constexpr = 1,
                              SCALE_BK: tl.constexpr = 1, QUANT_X: tl.constexpr = False,
                              EMULATE_FP8: tl.constexpr = False):
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
        if FP8:
            if SCALE_BN % BLOCK_N == 0:   # the program's columns lie in one row tile: [BLOCK_S, 1, BLOCK_K] scales
                n_tile = (tl.program_id(1) * BLOCK_N) // SCALE_BN
                sw = tl.load(s_ptr + experts[:, None] * stride_se + n_tile * stride_sn + (ks // SCALE_BK)[None, :],
                             mask=slot_ok[:, None] & k_ok[None, :], other=0.0)[:, None, :]
            else:
                sw = tl.load(s_ptr + experts[:, None, None] * stride_se + (cols // SCALE_BN)[None, :, None]
                             * stride_sn + (ks // SCALE_BK)[None, None, :], mask=row_ok & k_ok[None, None, :],
                             other=0.0)
            if not QUANT_X:
                w = _dequant(w, sw, inter_ptr.dtype.element_ty, RNE_BF16)
        a = tl.load(a_rows + ks[None, :], mask=slot_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        if QUANT_X:   # W8A8: each slot's inter row quantized in SCALE_BK groups
            aq, sx = _quantize_groups(a, BLOCK_K, SCALE_BK, EMULATE_FP8)                      # [BLOCK_S, BLOCK_K]
            acc += w.to(tl.float32) * aq[:, None, :] * (sw * sx[:, None, :])
        else:
            acc += w.to(tl.float32) * a[:, None, :]
    dtype = inter_ptr.dtype.element_ty
    y = _rounded(tl.sum(acc, axis=2), dtype, RNE_BF16)                                # [BLOCK_S, BLOCK_N]
    weight = tl.load(weights_ptr + rows, mask=slot_ok, other=0.0).to(tl.float32)
    out = _rounded(tl.sum(y * weight[:, None], axis=0), dtype, RNE_BF16)              # padded slots weigh 0
    tl.store(out_ptr + token * stride_o + cols, out.to(dtype), mask=col_ok)


def fused_experts_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                         topk_weights: torch.Tensor, silu_and_mul: Callable | None = None,
                         path: str | None = None, tiles: MoeTiles | None = None,
                         row_config: RowTiles | None = None, w13_scale: torch.Tensor | None = None,
                         w2_scale: torch.Tensor | None = None, block: tuple[int, int] | None = None,
                         quantize_x: bool = False) -> torch.Tensor:
    """fused_experts_torch's contract in two launches: x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_ids [T, k],
    topk_weights [T, k] -> [T, H] in x's dtype. silu_and_mul is accepted for the common signature and unused
    (the first kernel applies it). path: "rows" | "tiles" (None: rows up to ROWS_PATH_MAX (token, slot) rows);
    tiles: the tiles path's launch shape (None: `moe_tiles`, the tuned table for this shape and device, by T);
    row_config: the rows path's (None: `row_tiles`).

    FP8 experts (layers/moe_fp8.py): w13 / w2 float8_e4m3fn with w13_scale [E, 2 ceil(I / bn), ceil(H / bk)] and
    w2_scale [E, ceil(H / bn), ceil(I / bk)] for block = (bn, bk). Each weight tile is widened to x's dtype with its
    tile's scale as it is read (W8A16), the same roundings as the dequantized reference; the tiles path's K steps
    are cut to divide bk, so one step reads one scale column.

    quantize_x (FP8 experts only; bk a power of two >= 16): W8A8, vLLM's block-FP8 MoE on Hopper. x and inter are
    quantized to E4M3 per token and per bk-column group (DeepSeek-V3's 1 x 128 beside 128 x 128 weight tiles)
    inside the kernels' K loops, no pre-pass: the tiles path steps exactly bk along K, so a step's [BLOCK_M, bk]
    activation tile is one group a row, quantized in registers and multiplied FP8 x FP8 on the tensor cores, the
    float32 partial sum scaled by (activation scale x weight tile scale). The rows path (CUDA cores) quantizes the
    same groups (its steps made multiples of bk), so the two paths agree across ROWS_PATH_MAX. Oracle:
    layers/moe_fp8.py's fp8_w8a8_experts_reference."""
    num_tokens, topk = topk_ids.shape
    num_experts, two_i, hidden = w13.shape
    inter_size = two_i // 2
    num_rows = num_tokens * topk
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    fp8 = _fp8_args(w13, w2, w13_scale, w2_scale, block, quantize_x)
    path = path or ("rows" if num_rows <= ROWS_PATH_MAX else "tiles")
    if path == "rows":
        return _experts_by_rows(x, w13, w2, topk_ids, topk_weights, row_config, fp8)
    if path != "tiles":
        raise ValueError(f"path {path!r}: expected rows or tiles")
    t = tiles or moe_tiles(num_tokens, num_experts, inter_size, hidden, topk, x.device)
    if fp8 and quantize_x:   # one activation group a K step
        t = replace(t, block_k=block[1], down_block_k=block[1])
    elif fp8:
        t = _steps_within_scale_tiles(t, block[1])
    sorted_rows, tile_expert = align_by_expert(topk_ids, num_experts, t.block_m)
    grid_tiles = tile_expert.numel()
    dots = dict(DOT_FP32=_interpreted() and x.dtype == torch.bfloat16,
                DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                RNE_BF16=_interpreted() and x.dtype == torch.bfloat16)
    f13 = _fp8_kernel_args(fp8, "w13")
    f2 = _fp8_kernel_args(fp8, "w2")
    launch = dict(num_warps=t.num_warps, num_stages=t.num_stages)
    inter = torch.empty(num_rows, inter_size, dtype=x.dtype, device=x.device)
    _moe_gate_up_kernel[(grid_tiles, triton.cdiv(inter_size, t.block_n))](
        x, w13, sorted_rows, tile_expert, inter, num_rows, x.stride(0), w13.stride(0), w13.stride(1),
        inter.stride(0), TOPK=topk, H=hidden, I=inter_size, BLOCK_M=t.block_m, BLOCK_N=t.block_n,
        BLOCK_K=t.block_k, **dots, **launch, **f13)
    rows_out = torch.empty(num_rows, hidden, dtype=torch.float32, device=x.device)
    weights = topk_weights.reshape(-1).float().contiguous()
    _moe_down_kernel[(grid_tiles, triton.cdiv(hidden, t.down_block_n))](
        inter, w2, sorted_rows, tile_expert, weights, rows_out, num_rows, inter.stride(0), w2.stride(0),
        w2.stride(1), rows_out.stride(0), H=hidden, I=inter_size, BLOCK_M=t.block_m, BLOCK_N=t.down_block_n,
        BLOCK_K=t.down_block_k, **dots, **launch, **f2)
    return rows_out.view(num_tokens, topk, hidden).sum(dim=1).to(x.dtype)


def _experts_by_rows(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                     topk_weights: torch.Tensor, tiles: RowTiles | None = None, fp8: dict | None = None
                     ) -> torch.Tensor:
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
    if fp8 and fp8["quantize_x"]:   # W8A8: whole activation groups a step (bk and the steps are powers of two)
        t = replace(t, up_k=max(t.up_k, fp8["block"][1]), down_k=max(t.down_k, fp8["block"][1]))
    rne = _interpreted() and x.dtype == torch.bfloat16
    inter = torch.empty(num_rows, inter_size, dtype=x.dtype, device=x.device)
    _moe_gate_up_rows_kernel[(num_rows, triton.cdiv(inter_size, t.up_n))](
        x, w13, ids, inter, x.stride(0), w13.stride(0), w13.stride(1), inter.stride(0), TOPK=topk, H=hidden,
        I=inter_size, BLOCK_N=t.up_n, BLOCK_K=t.up_k, RNE_BF16=rne, num_warps=t.up_warps, **launch_options(x.device),
        **_fp8_kernel_args(fp8, "w13"))
    weights = topk_weights.reshape(-1)
    if weights.dtype != torch.float32 or not weights.is_contiguous():   # the router's are both: no copy
        weights = weights.float().contiguous()
    _moe_down_sum_rows_kernel[(num_tokens, triton.cdiv(hidden, t.down_n))](
        inter, w2, ids, weights, out, inter.stride(0), w2.stride(0), w2.stride(1), out.stride(0), TOPK=topk,
        H=hidden, I=inter_size, BLOCK_S=max(2, triton.next_power_of_2(topk)), BLOCK_N=t.down_n,
        BLOCK_K=t.down_k, RNE_BF16=rne, num_warps=t.down_warps, **launch_options(x.device),
        **_fp8_kernel_args(fp8, "w2"))
    return out


def _fp8_args(w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor | None, w2_scale: torch.Tensor | None,
              block: tuple[int, int] | None, quantize_x: bool = False) -> dict | None:
    """The FP8 experts' scales (contiguous float32), tile and W8A8 choice, checked against the weights; None for
    float ones."""
    if w13_scale is None:
        assert w13.dtype != torch.float8_e4m3fn, "FP8 experts need their scales (w13_scale, w2_scale, block)"
        assert not quantize_x, "quantize_x (W8A8) needs FP8 experts"
        return None
    assert w13.dtype == w2.dtype == torch.float8_e4m3fn and w2_scale is not None and block is not None
    bn, bk = block
    inter, hidden = w2.shape[2], w2.shape[1]
    assert tuple(w13_scale.shape) == (w13.shape[0], 2 * -(-inter // bn), -(-hidden // bk)), w13_scale.shape
    assert tuple(w2_scale.shape) == (w2.shape[0], -(-hidden // bn), -(-inter // bk)), w2_scale.shape
    # W8A8 quantizes activations in bk-wide groups held in one tensor (tl.arange and tl.dot: a power of two >= 16)
    assert not quantize_x or (bk & (bk - 1) == 0 and bk >= 16), f"W8A8 needs a power-of-two tile width >= 16: {bk}"
    return dict(w13=w13_scale.float().contiguous(), w2=w2_scale.float().contiguous(), block=block,
                quantize_x=quantize_x)


def _fp8_kernel_args(fp8: dict | None, which: str) -> dict:
    """A kernel's FP8 keyword arguments (none for float experts: the kernels' defaults compile the float road)."""
    if fp8 is None:
        return {}
    scale = fp8[which]
    args = dict(s_ptr=scale, stride_se=scale.stride(0), stride_sn=scale.stride(1), FP8=True,
                SCALE_BN=fp8["block"][0], SCALE_BK=fp8["block"][1])
    if fp8["quantize_x"]:
        args.update(QUANT_X=True, EMULATE_FP8=_interpreted())
    return args


def _steps_within_scale_tiles(t: MoeTiles, bk: int) -> MoeTiles:
    """Tiles whose K steps divide the scale tile's width bk, so each step multiplies by one scale column (a
    tuned 256-wide step becomes 128 at DeepSeek / Qwen3-FP8's 128); tl.dot needs K steps of at least 16."""
    def fit(k: int) -> int:
        while k > 16 and bk % k:
            k //= 2
        assert bk % k == 0, f"FP8 block width {bk} has no K step of 16 or more dividing it"
        return k
    return replace(t, block_k=fit(t.block_k), down_block_k=fit(t.down_block_k))


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
