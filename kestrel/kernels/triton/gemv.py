"""Skinny matmuls for decode: out = prologue(x) @ w.T for a handful of rows, at memory bandwidth.

At batch sizes 1..16 a linear layer is a weight read: w [N, K] (nn.Linear layout, K contiguous) is megabytes, the
activations are kilobytes. cuBLAS picks GEMM tiles that leave small weights well below HBM bandwidth and adds a
split-K reduce kernel for small N, and the RMSNorm / SiLU-and-mul in front of a projection are kernels of their own.
These kernels read every weight element exactly once across the grid and compute the activation prologue on the fly:

                      K (contiguous) ->
             +---------------------------------------+
    n0       | w tile [BLOCK_N, BLOCK_K] | next tile |   program pid owns rows n0 .. n0 + BLOCK_N - 1 and walks
    ..       |  (one coalesced load)     |  ...      |   all of K in BLOCK_K steps: no split-K, no reduce kernel,
    n0+BN-1  |                           |           |   no atomics. Small N takes a small BLOCK_N so the grid
             +---------------------------------------+   still covers every SM (N=1024, BLOCK_N=4: 256 programs).
    x rows   | a = prologue(x)[:, k0:k0+BLOCK_K]      |   every program recomputes its activation chunk from x
    [M, K]   +---------------------------------------+   (kilobytes, L2-resident) instead of a separate kernel.

    acc [BLOCK_N, BLOCK_M] (fp32) += w_tile @ a_chunk.T, then out[m, n] = acc[n, m] (+ bias[n]) in x's dtype.

Two ways to form the product, picked by the config (see default_config):
  - broadcast (M <= 4): per row m, tl.sum(w_tile * a_m[None, :], 1) on the CUDA cores; any BLOCK_N >= 1.
  - tensor cores (M > 4): tl.dot(w_tile, a_chunk.T) with a padded to BLOCK_M = 16 rows by masked loads (the extra
    rows cost FLOPs, not bytes: the kernel is memory bound); BLOCK_N >= 16.

Prologues, with the numerics of kestrel/kernels/triton/fused_ops.py (each `*_ref` below spells them out):
  - none:        a = x
  - add-RMSNorm: h = (x + residual) rounded to the model dtype; a = norm_w * (h * rsqrt(mean(h^2) + eps)).to(dtype).
                 A first pass over K sums h^2 per row, the second does the matmul, recomputing h; where a
                 program's K slice is one tile (broadcast path), one pass does both (one_pass_norm). Program 0
                 alone writes residual_out = h.
  - SiLU-mul:    gate_up [M, 2I] = [gate | up]; a = silu(gate).to(dtype) * up, rounded to dtype.
The matmul itself is F.linear's: fp32 accumulation, bias added in fp32, one rounding to the model dtype.

FP8 weights (`w_scale` given: w float8_e4m3fn [N, K], w_scale float32 [N, 1], W = w * w_scale, layers/fp8.py's
row scales): the tile is read at one byte an element and converted in registers (exact: every E4M3 value is a
16-bit float), the products summed as above, and each output row multiplied by its scale before the bias. The
prologues are unchanged, so an FP8 layer keeps the norm and SiLU-mul folds. The
accumulation order differs from cuBLAS / torch's CPU GEMM, so 16-bit outputs match the references to about an ulp.

On Hopper the kernel is launched with PDL (kestrel/kernels/triton/pdl.py): each program reads its first weight tile, then
waits for the kernel before it, so the weight stream starts while that kernel finishes. On the broadcast path
(M <= BROADCAST_MAX_M) that first tile is the program's whole K slice wherever it is at most WHOLE_SLICE_ELEMENTS
(Qwen3-0.6B: qkv, gate_up and down take one step instead of 2, 2 and 3), so no weight byte is read after the wait:
the 0.6B bs1 step went from 0.852 to 0.764 ms on the H200. The tensor-core path keeps K steps of ~TILE_ELEMENTS.

Launches are CUDA-graph capturable: no host syncs, no autotuning at call time (a fixed heuristic table keyed on
(M, N, K) picks the config; `config=` overrides it for benchmarking), only the outputs are allocated. M <= 16 is
asserted: larger batches belong to cuBLAS.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kestrel.kernels.triton.pdl import launch_options, pdl_wait

MAX_M = 16                  # rows this kernel serves; callers use cuBLAS above it
DOT_BLOCK_M = 16            # tl.dot needs every dim >= 16: x rows are padded to this by masked loads
BROADCAST_MAX_M = 4         # above this the CUDA-core FMAs (M per weight element) start to rival the load time
TARGET_PROGRAMS = 256       # ~2 per SM on a 132-SM H100/H200, so every SM streams weights
TILE_ELEMENTS = 8192        # weight elements per K step per program (16 KB in bf16): enough loads in flight
MAX_UNROLL = 16             # K steps fully unrolled (loads can be hoisted); longer loops are software-pipelined
WHOLE_SLICE_ELEMENTS = 16384   # a program's K slice up to 32 KB (bf16) read as one tile (8 warps above TILE_ELEMENTS)

PROLOGUE_NONE: tl.constexpr = tl.constexpr(0)
PROLOGUE_RMS: tl.constexpr = tl.constexpr(1)
PROLOGUE_SILU: tl.constexpr = tl.constexpr(2)


# ---------------------------------------------------------------------------------------------------------------
# torch references: the numerics the kernels are held to
# ---------------------------------------------------------------------------------------------------------------


def gemv_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ w[N, K].T (+ bias) -> [M, N] in x's dtype."""
    return F.linear(x, w, bias)


def add_rms_norm_gemv_ref(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                          w: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) @ w.T (+ bias), x + residual); residual None: the sum is x itself (no copy)."""
    h = x if residual is None else x + residual            # the residual stream is rounded to the model dtype
    hf = h.float()
    normed = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)
    return F.linear(norm_weight * normed, w, bias), h


def silu_mul_gemv_ref(gate_up: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """gate_up [M, 2I] = [gate | up] -> (silu(gate) * up) @ w[N, I].T (+ bias); silu rounds to the model dtype."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w, bias)


# ---------------------------------------------------------------------------------------------------------------
# configs
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GemvConfig:
    block_n: int            # weight rows per program; with use_dot below 16 K is folded 16 / block_n ways
    block_k: int            # K step
    use_dot: bool           # tensor cores (M padded to 16) instead of per-row broadcast FMAs
    num_warps: int = 4
    num_stages: int = 1     # software pipelining depth of the K loop when it is not unrolled
    unroll: bool = True     # K loop as tl.static_range: straight-line code whose loads can all be issued early


def default_config(m: int, n: int, k: int, element_size: int = 2) -> GemvConfig:
    """The fixed table (table_config), whole slices on the broadcast path; small tiles under Triton's interpreter.
    element_size: the weight's bytes an element (1: FP8 with w_scale)."""
    if _interpreted():   # small tiles so the tests' small shapes span several tiles in N and K
        return GemvConfig(block_n=16, block_k=64, use_dot=m > BROADCAST_MAX_M)
    return table_config(m, n, k, whole_slice=m <= BROADCAST_MAX_M, element_size=element_size)


def table_config(m: int, n: int, k: int, whole_slice: bool = False, element_size: int = 2) -> GemvConfig:
    """BLOCK_N as large as keeps >= TARGET_PROGRAMS programs, BLOCK_K for ~TILE_ELEMENTS a step.

    Examples (bf16, H200): N=1024 K=3072 M=1 -> BLOCK_N 4 x BLOCK_K 1024 (256 programs, 3 unrolled steps);
    N=4096 K=14336 -> 16 x 512 (256 programs, 28 pipelined steps); N=28672 K=4096 -> 32 x 256 (896 programs).
    whole_slice: one step of BLOCK_K = next_power_of_2(K) (masked tail) where BLOCK_N x that is at most
    WHOLE_SLICE_ELEMENTS, with 8 warps above TILE_ELEMENTS to keep the tile in registers.

    FP8 weights (element_size 1) on the broadcast path: the K step holds the bf16 step's bytes, twice its
    elements (a 1-byte weight moves half the bytes per element, so the same elements would halve the bytes in
    flight), on 8 warps so each thread still converts ~64 weights to float32: N=4096 K=14336 M=1 -> 16 x 1024
    (14 pipelined steps), N=6144 K=4096 -> 16 x 1024 (4 steps); FP8 loops are never unrolled (compile time,
    below). The tensor-core path (M > 4) and whole slices
    keep the bf16 elements: registers (the padded x operand, the whole tile) bound them, not bytes. bf16
    (element_size 2) is the table above, unchanged.
    """
    use_dot = m > BROADCAST_MAX_M
    # Every program reads all M x rows from L2 per weight tile: M / BLOCK_N x the weight bytes. So the tensor-core
    # path (M up to 16) starts at BLOCK_N 8 (fold 2), the broadcast path (M <= 4) at 4.
    block_n = 8 if use_dot else 4
    while block_n < 32 and triton.cdiv(n, 2 * block_n) >= TARGET_PROGRAMS:
        block_n *= 2
    whole = triton.next_power_of_2(k)
    if whole_slice and block_n * whole <= WHOLE_SLICE_ELEMENTS:
        return GemvConfig(block_n=block_n, block_k=whole, use_dot=use_dot,
                          num_warps=8 if block_n * whole > TILE_ELEMENTS else 4)
    # FP8 on the broadcast path: TILE_ELEMENTS bf16 elements' bytes a step. The tensor-core path keeps the bf16
    # step: its x operand [16, BLOCK_K] (the model dtype) is what fills the registers there (2x spilled on sm_90)
    tile_elements = TILE_ELEMENTS if use_dot else TILE_ELEMENTS * 2 // element_size
    block_k = _even_block_k(k, max(tile_elements // block_n, 128))
    steps = triton.cdiv(k, block_k)
    # FP8 keeps the K loop rolled (software-pipelined): fully unrolled, its dequantizing steps took Triton 116 s to
    # build for the 8B layers at M = 1, 2, 4, 8 (sm_90, Triton's ptxas, on the project's 2-core VM) against 26 s
    # rolled, and a fresh server compiles every one of them before it is ready
    unroll = steps <= MAX_UNROLL and element_size == 2
    return GemvConfig(block_n=block_n, block_k=block_k, use_dot=use_dot,
                      num_warps=4 if block_n * block_k <= TILE_ELEMENTS else 8,
                      num_stages=1 if unroll else 3, unroll=unroll)


def _even_block_k(k: int, target: int) -> int:
    """The largest power of two <= target that divides K (no masked tail), else target capped at K's size."""
    block = triton.next_power_of_2(target) if target & (target - 1) else target
    block = min(block, triton.next_power_of_2(k))
    candidate = block
    while candidate >= 128:
        if k % candidate == 0:
            return candidate
        candidate //= 2
    return block


# ---------------------------------------------------------------------------------------------------------------
# kernel
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def _residual_sum(x_ptr, res_ptr, x_offs, r_offs, mask, HAS_RES: tl.constexpr):
    """h = x (+ residual, summed in fp32 and rounded to the model dtype like torch's bf16 add)."""
    h = tl.load(x_ptr + x_offs, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + r_offs, mask=mask, other=0.0)
        h = (h.to(tl.float32) + r.to(tl.float32)).to(h.dtype)
    return h


@triton.jit
def _activation(x_ptr, res_ptr, x_offs, r_offs, mask, norm_w, rstd,
                K: tl.constexpr, PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr):
    """prologue(x) at the given offsets, rounded to the model dtype (any tile shape; rstd broadcasts over it)."""
    if PROLOGUE == PROLOGUE_SILU:
        gate = tl.load(x_ptr + x_offs, mask=mask, other=0.0)
        up = tl.load(x_ptr + x_offs + K, mask=mask, other=0.0)
        g = gate.to(tl.float32)
        act = (g * tl.sigmoid(g)).to(gate.dtype).to(tl.float32)     # F.silu rounds to the model dtype
        a = (act * up.to(tl.float32)).to(gate.dtype)
    else:
        a = _residual_sum(x_ptr, res_ptr, x_offs, r_offs, mask, HAS_RES)
        if PROLOGUE == PROLOGUE_RMS:
            a = _rms_scale(a, norm_w, rstd)
    return a


@triton.jit
def _rms_scale(h, norm_w, rstd):
    """norm_w * (h * rstd), with RMSNorm's two roundings to the model dtype (fused_ops.rms_norm_ref's numerics)."""
    normed = (h.to(tl.float32) * rstd).to(h.dtype).to(tl.float32)
    return (norm_w * normed).to(h.dtype)


@triton.jit
def _row_rstd(x_ptr, res_ptr, res_out_ptr, pid, M, stride_xm, stride_rm, stride_rom, eps,
              K: tl.constexpr, HAS_RES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Pass 1 of add-RMSNorm: rsqrt(mean(h^2) + eps) per row [BLOCK_M]; program 0 also stores h = residual_out."""
    rows = tl.arange(0, BLOCK_M)
    row_mask = rows < M
    sumsq = tl.zeros([BLOCK_M], tl.float32)
    for k0 in tl.static_range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        mask = row_mask[:, None] & (ks[None, :] < K)
        h = _residual_sum(x_ptr, res_ptr, rows[:, None] * stride_xm + ks[None, :],
                          rows[:, None] * stride_rm + ks[None, :], mask, HAS_RES)
        if HAS_RES:
            tl.store(res_out_ptr + rows[:, None] * stride_rom + ks[None, :], h, mask=mask & (pid == 0))
        hf = h.to(tl.float32)
        sumsq += tl.sum(hf * hf, 1)
    return tl.rsqrt(sumsq / K + eps)


@triton.jit
def _dot_w_tile(w_ptr, k0, n0, N, stride_wn, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                FOLD: tl.constexpr):
    """w' [BLOCK_N * FOLD, BLOCK_K / FOLD] for K chunk k0: row r = n * FOLD + h holds
    w[n0 + n, k0 + h * KF : k0 + (h + 1) * KF] (KF = BLOCK_K / FOLD); see _dot_mac."""
    KF: tl.constexpr = BLOCK_K // FOLD
    j = tl.arange(0, KF)
    r = tl.arange(0, BLOCK_N * FOLD)
    w_rows = n0 + r // FOLD
    w_cols = k0 + (r % FOLD) * KF
    return tl.load(w_ptr + w_rows[:, None] * stride_wn + w_cols[:, None] + j[None, :],
                   mask=(w_rows[:, None] < N) & (w_cols[:, None] + j[None, :] < K), other=0.0)


@triton.jit
def _dot_mac(acc, w, k0, x_ptr, res_ptr, norm_w_ptr, rstd, M, stride_xm, stride_rm,
             K: tl.constexpr, PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, FOLD: tl.constexpr,
             DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc [BLOCK_N * FOLD, FOLD * BLOCK_M] += w' @ a'.T over K chunk k0 .. k0 + BLOCK_K, K folded FOLD ways.

    Row c = g * BLOCK_M + m of a' holds slice g of x row m (the slices of _dot_w_tile's rows), so the blocks with
    h == g are the partial sums wanted (see _unfold). Memory traffic is that of a [BLOCK_N, BLOCK_K] tile; the
    folding only lets BLOCK_N go below tl.dot's 16 (more programs for small N) at the price of FOLD x the (idle)
    tensor-core work.
    """
    KF: tl.constexpr = BLOCK_K // FOLD
    j = tl.arange(0, KF)
    c = tl.arange(0, FOLD * BLOCK_M)
    a_rows = c % BLOCK_M
    a_cols = k0 + (c // BLOCK_M) * KF
    ks = a_cols[:, None] + j[None, :]                                   # [FOLD * BLOCK_M, KF]
    mask = (a_rows[:, None] < M) & (ks < K)
    norm_w = 0.0
    scale = 0.0
    if PROLOGUE == PROLOGUE_RMS:
        norm_w = tl.load(norm_w_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)
        scale = tl.reshape(tl.broadcast_to(rstd[None, :], [FOLD, BLOCK_M]), [FOLD * BLOCK_M])[:, None]
    a = _activation(x_ptr, res_ptr, a_rows[:, None] * stride_xm + ks, a_rows[:, None] * stride_rm + ks, mask,
                    norm_w, scale, K, PROLOGUE, HAS_RES)
    if DOT_FP32:   # Triton's interpreter gets bf16 dots wrong
        w = w.to(tl.float32)
        a = a.to(tl.float32)
    else:
        w = w.to(a.dtype)   # FP8 weights into the activations' dtype (exact); a no-op otherwise
    return acc + tl.dot(w, tl.trans(a), input_precision=DOT_PRECISION)


@triton.jit
def _unfold(acc, BLOCK_N: tl.constexpr, FOLD: tl.constexpr, BLOCK_M: tl.constexpr):
    """[BLOCK_N * FOLD, FOLD * BLOCK_M] folded partial sums -> [BLOCK_N, BLOCK_M]: sum the blocks with h == g."""
    if FOLD == 1:
        out = acc
    else:
        parts = tl.reshape(acc, [BLOCK_N, FOLD, FOLD, BLOCK_M])
        h = tl.arange(0, FOLD)
        same = h[:, None] == h[None, :]                                 # [FOLD (h), FOLD (g)]
        parts = tl.where(same[None, :, :, None], parts, 0.0)
        out = tl.sum(tl.sum(parts, 2), 1)
    return out


@triton.jit
def _broadcast_w_tile(w_ptr, k0, n0, N, stride_wn, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """w [BLOCK_N, BLOCK_K] for K chunk k0, as loaded (the model dtype)."""
    ks = k0 + tl.arange(0, BLOCK_K)
    n_offs = n0 + tl.arange(0, BLOCK_N)
    return tl.load(w_ptr + n_offs[:, None] * stride_wn + ks[None, :], mask=(n_offs[:, None] < N) & (ks[None, :] < K),
                   other=0.0)


@triton.jit
def _broadcast_mac(acc, w, k0, x_ptr, res_ptr, norm_w_ptr, rstd, M, stride_xm, stride_rm,
                   K: tl.constexpr, PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] += w tile @ prologue(x)[:, k0:k0+BLOCK_K].T, one x row at a time on the CUDA cores."""
    ks = k0 + tl.arange(0, BLOCK_K)
    k_mask = ks < K
    w = w.to(tl.float32)
    norm_w = 0.0
    if PROLOGUE == PROLOGUE_RMS:
        norm_w = tl.load(norm_w_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)
    rows = tl.arange(0, BLOCK_M)
    for m in tl.static_range(BLOCK_M):
        rstd_m = 0.0
        if PROLOGUE == PROLOGUE_RMS:
            rstd_m = tl.sum(tl.where(rows == m, rstd, 0.0), 0)
        a = _activation(x_ptr, res_ptr, m * stride_xm + ks, m * stride_rm + ks, k_mask & (m < M),
                        norm_w, rstd_m, K, PROLOGUE, HAS_RES).to(tl.float32)
        part = tl.sum(w * a[None, :], 1)                                  # [BLOCK_N]
        acc += tl.where(rows[None, :] == m, part[:, None], 0.0)
    return acc


@triton.jit
def _broadcast_one_pass_norm_mac(acc, w, norm_w, x_ptr, res_ptr, res_out_ptr, pid, M, stride_xm, stride_rm,
                                 stride_rom, eps, K: tl.constexpr, HAS_RES: tl.constexpr,
                                 BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """_row_rstd + _broadcast_mac in one pass, for a program whose whole K slice is one tile (BLOCK_K >= K): each
    x row is read once and its rstd and activation come from the same registers. Two passes read x twice, one
    L2 round trip after the other, both after the PDL wait. norm_w [BLOCK_K] fp32 was read before the wait."""
    ks = tl.arange(0, BLOCK_K)
    k_mask = ks < K
    w = w.to(tl.float32)
    rows = tl.arange(0, BLOCK_M)
    for m in tl.static_range(BLOCK_M):
        mask = k_mask & (m < M)
        h = _residual_sum(x_ptr, res_ptr, m * stride_xm + ks, m * stride_rm + ks, mask, HAS_RES)
        if HAS_RES:
            tl.store(res_out_ptr + m * stride_rom + ks, h, mask=mask & (pid == 0))
        hf = h.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(hf * hf, 0) / K + eps)
        a = _rms_scale(h, norm_w, rstd).to(tl.float32)
        part = tl.sum(w * a[None, :], 1)                                  # [BLOCK_N]
        acc += tl.where(rows[None, :] == m, part[:, None], 0.0)
    return acc


@triton.jit
def _w_tile(w_ptr, k0, n0, N, stride_wn, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
            USE_DOT: tl.constexpr, FOLD: tl.constexpr):
    if USE_DOT:
        w = _dot_w_tile(w_ptr, k0, n0, N, stride_wn, K, BLOCK_N, BLOCK_K, FOLD)
    else:
        w = _broadcast_w_tile(w_ptr, k0, n0, N, stride_wn, K, BLOCK_N, BLOCK_K)
    return w


@triton.jit
def _mac(acc, w, k0, x_ptr, res_ptr, norm_w_ptr, rstd, M, stride_xm, stride_rm,
         K: tl.constexpr, PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr,
         BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr,
         FOLD: tl.constexpr, DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr):
    if USE_DOT:
        acc = _dot_mac(acc, w, k0, x_ptr, res_ptr, norm_w_ptr, rstd, M, stride_xm, stride_rm,
                       K, PROLOGUE, HAS_RES, BLOCK_M, BLOCK_K, FOLD, DOT_FP32, DOT_PRECISION)
    else:
        acc = _broadcast_mac(acc, w, k0, x_ptr, res_ptr, norm_w_ptr, rstd, M, stride_xm, stride_rm,
                             K, PROLOGUE, HAS_RES, BLOCK_M, BLOCK_K)
    return acc


@triton.jit
def _skinny_matmul_kernel(
    x_ptr, res_ptr, norm_w_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, res_out_ptr,
    M, N, stride_xm, stride_rm, stride_rom, stride_wn, stride_om, eps,
    K: tl.constexpr, PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr, FOLD: tl.constexpr, UNROLL: tl.constexpr,
    DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr, ONE_PASS_NORM: tl.constexpr,
    HAS_W_SCALE: tl.constexpr,
):
    pid = tl.program_id(0)
    n0 = pid * BLOCK_N
    # The first weight tile does not depend on the kernel before this one: under PDL it is read while that
    # kernel finishes (for most decode shapes it is the program's whole slice of w). So is the norm weight.
    w = _w_tile(w_ptr, 0, n0, N, stride_wn, K, BLOCK_N, BLOCK_K, USE_DOT, FOLD)
    if ONE_PASS_NORM:   # add-RMSNorm on the broadcast path with all of K in one tile (see one_pass_norm)
        norm_w = tl.load(norm_w_ptr + tl.arange(0, BLOCK_K), mask=tl.arange(0, BLOCK_K) < K, other=0.0)
        pdl_wait(USE_PDL)
        acc = _broadcast_one_pass_norm_mac(tl.zeros([BLOCK_N, BLOCK_M], tl.float32), w, norm_w.to(tl.float32),
                                           x_ptr, res_ptr, res_out_ptr, pid, M, stride_xm, stride_rm, stride_rom,
                                           eps, K, HAS_RES, BLOCK_M, BLOCK_K)
    else:
        pdl_wait(USE_PDL)
        rstd = tl.zeros([BLOCK_M], tl.float32)
        if PROLOGUE == PROLOGUE_RMS:
            rstd = _row_rstd(x_ptr, res_ptr, res_out_ptr, pid, M, stride_xm, stride_rm, stride_rom, eps,
                             K, HAS_RES, BLOCK_M, BLOCK_K)
        acc = tl.zeros([BLOCK_N * FOLD, FOLD * BLOCK_M], tl.float32)
        acc = _mac(acc, w, 0, x_ptr, res_ptr, norm_w_ptr, rstd, M, stride_xm, stride_rm, K, PROLOGUE, HAS_RES,
                   BLOCK_M, BLOCK_K, USE_DOT, FOLD, DOT_FP32, DOT_PRECISION)
    if UNROLL:
        for k0 in tl.static_range(BLOCK_K, K, BLOCK_K):
            w = _w_tile(w_ptr, k0, n0, N, stride_wn, K, BLOCK_N, BLOCK_K, USE_DOT, FOLD)
            acc = _mac(acc, w, k0, x_ptr, res_ptr, norm_w_ptr, rstd, M, stride_xm, stride_rm, K, PROLOGUE,
                       HAS_RES, BLOCK_M, BLOCK_K, USE_DOT, FOLD, DOT_FP32, DOT_PRECISION)
    else:
        for k0 in range(BLOCK_K, K, BLOCK_K):
            w = _w_tile(w_ptr, k0, n0, N, stride_wn, K, BLOCK_N, BLOCK_K, USE_DOT, FOLD)
            acc = _mac(acc, w, k0, x_ptr, res_ptr, norm_w_ptr, rstd, M, stride_xm, stride_rm, K, PROLOGUE,
                       HAS_RES, BLOCK_M, BLOCK_K, USE_DOT, FOLD, DOT_FP32, DOT_PRECISION)
    out = _unfold(acc, BLOCK_N, FOLD, BLOCK_M)
    n_offs = n0 + tl.arange(0, BLOCK_N)
    n_mask = n_offs < N
    if HAS_W_SCALE:   # FP8 weights: one scale per output row
        out = out * tl.load(w_scale_ptr + n_offs, mask=n_mask, other=0.0)[:, None]
    if HAS_BIAS:
        out += tl.load(bias_ptr + n_offs, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    rows = tl.arange(0, BLOCK_M)
    tl.store(out_ptr + rows[None, :] * stride_om + n_offs[:, None], out.to(out_ptr.dtype.element_ty),
             mask=n_mask[:, None] & (rows[None, :] < M))


# ---------------------------------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------------------------------


def gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
         config: GemvConfig | None = None, w_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Triton twin of gemv_ref: x [M <= 16, K] (unit last stride) @ w [N, K].T (+ bias [N]) -> [M, N]; with
    w_scale, w is FP8 and W = w * w_scale (module docstring)."""
    return _launch(PROLOGUE_NONE.value, x, None, None, 0.0, w, bias, w.shape[1], config, w_scale)[0]


def add_rms_norm_gemv(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                      w: torch.Tensor, bias: torch.Tensor | None = None, config: GemvConfig | None = None,
                      w_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of add_rms_norm_gemv_ref: (rms_norm(x + residual) @ w.T (+ bias) [M, N], x + residual [M, K]).

    With residual None the second result is x itself.
    """
    hidden = x.shape[-1]
    assert norm_weight.shape == (hidden,), f"norm_weight {tuple(norm_weight.shape)} does not match K={hidden}"
    assert norm_weight.dtype == x.dtype, f"norm_weight {norm_weight.dtype} != x {x.dtype}"
    if residual is not None:
        assert residual.shape == x.shape, f"residual {tuple(residual.shape)} != x {tuple(x.shape)}"
        assert residual.dtype == x.dtype and residual.stride(-1) == 1, "residual: x's dtype, unit last stride"
    out, res_out = _launch(PROLOGUE_RMS.value, x, residual, norm_weight, eps, w, bias, hidden, config, w_scale)
    return out, (x if residual is None else res_out)


def silu_mul_gemv(gate_up: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                  config: GemvConfig | None = None, w_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Triton twin of silu_mul_gemv_ref: gate_up [M <= 16, 2I] = [gate | up], w [N, I] -> [M, N]."""
    width = gate_up.shape[-1]
    assert width % 2 == 0, f"gate_up's last dim {width} is not [gate | up]"
    return _launch(PROLOGUE_SILU.value, gate_up, None, None, 0.0, w, bias, width // 2, config, w_scale)[0]


def _launch(prologue: int, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor | None,
            eps: float, w: torch.Tensor, bias: torch.Tensor | None, k: int, config: GemvConfig | None,
            w_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    _check_operands(x, w, bias, k, w_scale)
    m, n = x.shape[0], w.shape[0]
    cfg = config or default_config(m, n, k, w.element_size())
    fold = _fold(cfg)
    assert cfg.block_k // fold >= 16, f"{cfg}: tl.dot needs BLOCK_K / FOLD >= 16"
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    with_res = residual is not None
    res_out = torch.empty(m, k, dtype=x.dtype, device=x.device) if with_res else None
    if m == 0 or n == 0:
        return out, res_out
    block_m = DOT_BLOCK_M if cfg.use_dot else triton.next_power_of_2(m)
    res, ro = (residual, res_out) if with_res else (x, out)     # unused by the kernel without a residual
    _skinny_matmul_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, res, norm_weight if norm_weight is not None else w, w, w_scale if w_scale is not None else w,
        bias if bias is not None else w, out, ro,
        m, n, x.stride(0), res.stride(0), ro.stride(0), w.stride(0), out.stride(0), eps,
        K=k, PROLOGUE=prologue, HAS_RES=with_res, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        USE_DOT=cfg.use_dot, FOLD=fold, UNROLL=cfg.unroll,
        DOT_FP32=_interpreted() and x.dtype == torch.bfloat16,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",   # fp32 models keep exact fp32 dots
        ONE_PASS_NORM=prologue == PROLOGUE_RMS.value and one_pass_norm(cfg, k), HAS_W_SCALE=w_scale is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_options(x.device),
    )
    return out, res_out


def one_pass_norm(cfg: GemvConfig, k: int) -> bool:
    """Whether add-RMSNorm reads each x row once (rstd and activation from the same registers, the norm weight
    read before the PDL wait): on the broadcast path when a program's K slice is one tile, as in the whole-slice
    configs of the Qwen3-0.6B's qkv and gate_up at one to four rows (−1.8% on its bs1 step on the H200). Otherwise
    two passes over x."""
    return not cfg.use_dot and cfg.block_k >= k


def _fold(cfg: GemvConfig) -> int:
    """K folds that give tl.dot its 16 rows when BLOCK_N < 16 (see _dot_mac)."""
    return max(1, DOT_BLOCK_M // cfg.block_n) if cfg.use_dot else 1


def _check_operands(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, k: int,
                    w_scale: torch.Tensor | None = None) -> None:
    assert x.dim() == 2 and w.dim() == 2, f"x {tuple(x.shape)} and w {tuple(w.shape)} must be 2-D"
    assert x.shape[0] <= MAX_M, f"skinny matmul serves M <= {MAX_M} rows, got {x.shape[0]}: use F.linear"
    assert w.shape[1] == k, f"w {tuple(w.shape)} does not take K={k}"
    assert x.stride(-1) == 1 and w.stride(-1) == 1, "x and w need a unit last stride"
    if w_scale is None:
        assert w.dtype == x.dtype, f"w {w.dtype} != x {x.dtype}"
    else:
        assert w.dtype == torch.float8_e4m3fn, f"w_scale goes with FP8 weights, not {w.dtype}"
        assert w_scale.dtype == torch.float32 and w_scale.numel() == w.shape[0] and w_scale.is_contiguous(), \
            f"w_scale must be float32 [{w.shape[0]}, 1], got {w_scale.dtype} {tuple(w_scale.shape)}"
    if bias is not None:
        assert bias.shape == (w.shape[0],) and bias.dtype == x.dtype, f"bias must be [{w.shape[0]}] in {x.dtype}"
        assert bias.stride(0) == 1, "bias must be contiguous"


def _interpreted() -> bool:
    return bool(triton.knobs.runtime.interpret)
