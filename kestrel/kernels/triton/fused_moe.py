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

An expert with no tokens gets no tile; a tile of an unused expert id (-1) masks every load and store. Operands are
upcast to float32 before tl.dot (the interpreter's bf16 dot is wrong; see tests/test_triton_kernels.py), which a
tuned GPU version would drop along with picking block sizes per shape.
"""
from __future__ import annotations

from typing import Callable

import torch
import triton
import triton.language as tl

BLOCK_M = 16


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_rows [capacity] int32, tile_expert [capacity / block_m] int32), drawn in the module docstring."""
    flat = topk_ids.reshape(-1).long()
    num_rows = flat.numel()
    counts = torch.bincount(flat, minlength=num_experts)
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
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile)
    used = expert >= 0
    expert = tl.maximum(expert, 0).to(tl.int64)
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
                    other=0.0).to(tl.float32)
        w_mask = k_ok[:, None] & col_ok[None, :] & used
        wg = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None], mask=w_mask, other=0.0).to(tl.float32)
        wu = tl.load(w_base + (cols[None, :] + I) * stride_wn + ks[:, None], mask=w_mask, other=0.0).to(tl.float32)
        gate += tl.dot(a, wg)
        up += tl.dot(a, wu)
    # as the reference: silu(gate) rounded to the model dtype, then times up
    act = (gate * tl.sigmoid(gate)).to(inter_ptr.dtype.element_ty).to(tl.float32) * \
        up.to(inter_ptr.dtype.element_ty).to(tl.float32)
    tl.store(inter_ptr + rows[:, None].to(tl.int64) * stride_i + cols[None, :],
             act.to(inter_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _moe_down_kernel(inter_ptr, w2_ptr, sorted_rows_ptr, tile_expert_ptr, weights_ptr, out_ptr, num_rows,
                     stride_i, stride_we, stride_wn, stride_o,
                     H: tl.constexpr, I: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile)
    used = expert >= 0
    expert = tl.maximum(expert, 0).to(tl.int64)
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
                    other=0.0).to(tl.float32)
        w = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None], mask=k_ok[:, None] & col_ok[None, :] & used,
                    other=0.0).to(tl.float32)
        acc += tl.dot(a, w)
    # the expert's output in the model dtype (as the reference's F.linear), then weighed in float32
    acc = acc.to(inter_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weights_ptr + rows64, mask=valid, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows64[:, None] * stride_o + cols[None, :], acc * weight[:, None],
             mask=valid[:, None] & col_ok[None, :])


def fused_experts_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                         topk_weights: torch.Tensor, silu_and_mul: Callable | None = None,
                         block_n: int = 32, block_k: int = 32) -> torch.Tensor:
    """fused_experts_torch's contract in two launches: x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_ids [T, k],
    topk_weights [T, k] -> [T, H] in x's dtype. silu_and_mul is accepted for the common signature and unused
    (the first kernel applies it)."""
    num_tokens, topk = topk_ids.shape
    num_experts, two_i, hidden = w13.shape
    inter_size = two_i // 2
    num_rows = num_tokens * topk
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    sorted_rows, tile_expert = align_by_expert(topk_ids, num_experts)
    tiles = tile_expert.numel()
    inter = torch.empty(num_rows, inter_size, dtype=x.dtype, device=x.device)
    _moe_gate_up_kernel[(tiles, triton.cdiv(inter_size, block_n))](
        x, w13, sorted_rows, tile_expert, inter, num_rows, x.stride(0), w13.stride(0), w13.stride(1),
        inter.stride(0), TOPK=topk, H=hidden, I=inter_size, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k)
    rows_out = torch.empty(num_rows, hidden, dtype=torch.float32, device=x.device)
    weights = topk_weights.reshape(-1).float().contiguous()
    _moe_down_kernel[(tiles, triton.cdiv(hidden, block_n))](
        inter, w2, sorted_rows, tile_expert, weights, rows_out, num_rows, inter.stride(0), w2.stride(0),
        w2.stride(1), rows_out.stride(0), H=hidden, I=inter_size, BLOCK_M=BLOCK_M, BLOCK_N=block_n,
        BLOCK_K=block_k)
    return rows_out.view(num_tokens, topk, hidden).sum(dim=1).to(x.dtype)
