"""FP8 skinny matmul for decode: out = x @ (w8 * scale).T for a handful of rows, reading one byte per weight.

At batch sizes 1..16 a linear layer is a weight read (kernels/triton/gemv.py); FP8 weights halve the bytes, so the
kernel must keep twice the weight bytes in flight per unit of time to stay at HBM bandwidth. The grid is
(N blocks, K splits): a program owns BLOCK_N rows and one contiguous K range of K_SPLIT elements (= bytes):

                         K (contiguous, 1 byte an element) ->
             |<------------- split 0 -------------->|<------------- split 1 -------------->|
             +-------------------------------------+--------------------------------------+
    n0       | step [T x BLOCK_N x SEG]  | step ... | step                      | ...      |   program (pid_n, s)
    ..       |  seg | seg | seg | seg    |          |  seg | seg | seg | seg    |          |   walks its split in
    n0+BN-1  |                           |          |                           |          |   BLOCK_K steps
             +-------------------------------------+--------------------------------------+
    x rows   | [M, K] (kilobytes, L2-resident), read per step                               |

  - a step loads one [T, BLOCK_N, SEG] tile (BLOCK_K = T x SEG bytes a row, one coalesced load): SEG divides the
    scale tile's width, so every segment lies in one scale column and takes one scale per row.
  - broadcast (M <= 4): per x row, tl.sum(w * a, SEG) on the CUDA cores. Tensor cores (M > 4): a batched
    tl.dot over the T segments, x padded to 16 rows by masked loads (FLOPs, not bytes).
  - split-K (small N, long K: qkv, o, down of an 8B model): without it N / BLOCK_N programs (256 at N=4096) each
    walk all of K and too few bytes are in flight. Each split writes its float32 partial sums to a workspace
    [SPLIT_K, M, N]; a second small kernel (_split_sum_kernel) sums the splits in a fixed order, adds the bias
    and rounds once to x's dtype. Deterministic (no atomics) and nothing to zero first.

Where the scales go:
  - row scales [N, 1] (per channel; a per-tensor checkpoint's scalars written into their rows): in the epilogue,
    acc[n, :] *= scale[n], one multiply per output (per partial sum under split-K: it distributes).
  - tile scales [ceil(N / bn), ceil(K / bk)] (DeepSeek-V3 / Qwen3-FP8 blocks): per segment, its partial sums
    [BLOCK_N] times scale[n // bn, k_seg // bk], then summed over the segments.

Folds (gemv.py's prologues, so block-scaled layers keep the bf16 road's launch count at decode): the add +
RMSNorm before qkv and gate|up (fp8_add_rms_norm_gemv: rstd from a first pass over the few x rows, x + residual
stored once by program (0, 0)) and the SiLU-mul before down (fp8_silu_mul_gemv: x = [gate | up]) are applied to
x as each step loads it; their numerics are gemv.py's references on the dequantized weights.

The numerics are fp8_gemv_ref's: float32 products and accumulation of the exactly converted weight (the scale
multiplies partial sums of one scale tile), bias added in float32, one rounding to x's dtype; split-K changes
the summation order only. Launches are CUDA-graph capturable: no host syncs, no autotuning at call time (the fixed
table in default_config picks the config; `config=` overrides it for benchmarking), only the output and the
workspace are allocated. Both kernels are launched with PDL on Hopper (kernels/triton/pdl.py): the first weight
step is read before the wait.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kestrel.kernels.triton.gemv import (PROLOGUE_NONE, PROLOGUE_RMS, PROLOGUE_SILU, _activation, _row_rstd,
                                         add_rms_norm_gemv_ref, silu_mul_gemv_ref)
from kestrel.kernels.triton.pdl import launch_options, pdl_wait
from kestrel.kernels.fp8_quant import dequantize

MAX_M = 16
BROADCAST_MAX_M = 4      # above this the CUDA-core FMAs (M per weight byte) rival the load time: tensor cores
DOT_BLOCK_M = 16         # tl.dot needs every dim >= 16: x rows padded by masked loads
MIN_SEG = 16             # tl.dot's K; the smallest scale-tile width served (fp8.py checks it before routing here)
DOT_SEG = 128            # the widest segment a tensor-core step takes (see _seg)


# ---------------------------------------------------------------------------------------------------------------
# reference
# ---------------------------------------------------------------------------------------------------------------


def fp8_gemv_ref(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ dequantize(w8, scale, block).T (+ bias) in float32, rounded once to x's dtype."""
    out = x.float() @ dequantize(w8, scale, block).T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


# ---------------------------------------------------------------------------------------------------------------
# configs
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fp8GemvConfig:
    block_n: int             # weight rows per program (>= 16 with use_dot)
    block_k: int             # K elements (= weight bytes) of a row per step, a power of two
    split_k: int = 1         # programs along K, at most; each covers whole steps (fewer when K is short)
    use_dot: bool = False    # tensor cores (x padded to 16 rows) instead of per-row broadcast FMAs
    num_warps: int = 4
    num_stages: int = 3      # software pipelining depth of the step loop when it is not unrolled
    unroll: bool = False     # steps as tl.static_range: straight-line code whose loads can all be issued early


# The fixed table, as data. Bytes in flight decide the time: a step of BLOCK_N x STEP_BYTES = 8 KB a program,
# and enough programs that every SM holds several (H100/H200: 132 SMs). N / BLOCK_N programs are multiplied by
# K splits (powers of two) while the grid stays within TARGET_PROGRAMS (one wave: a second, partial wave would
# stream at a fraction of the bandwidth) and every split keeps MIN_SPLIT_STEPS steps.
BLOCK_N = 16
STEP_BYTES = 512             # a row's bytes per step: 4 x 128-byte lines (the old kernel read one)
TARGET_PROGRAMS = 1024       # one wave at 8 resident programs of 4 warps (<= 64 registers: M=1 builds 56-68)
MIN_SPLIT_STEPS = 2          # a split shorter than this is mostly prologue and epilogue
MAX_SPLIT_K = 16
MAX_UNROLL = 8               # steps a split unrolls; longer splits are software-pipelined
# Predicted (H100, bs1, bytes / 2.5 TB/s + ~1.5 us for the split sum; not yet measured): qkv 11.6 us (was 30.3),
# o 8.2, gate_up 46 (was 45.7), down 25 (was 72.0). benchmarks/fp8_gemv_bench.py checks it.


def default_config(m: int, n: int, k: int) -> Fp8GemvConfig:
    """table_config; small tiles and two splits under Triton's interpreter (the tests' shapes span several)."""
    if _interpreted():
        return Fp8GemvConfig(block_n=16, block_k=64, split_k=2 if k > 128 else 1, use_dot=m > BROADCAST_MAX_M,
                             unroll=True)
    return table_config(m, n, k)


def table_config(m: int, n: int, k: int) -> Fp8GemvConfig:
    """The table above for (M, N, K). Llama-3.1-8B (block_n 16, block_k 512; broadcast at M <= 4, tensor cores
    above): qkv N=6144 K=4096 -> 384 programs x 2 splits of 4 steps (unrolled), o 4096x4096 -> 256 x 4 of 2,
    gate_up N=28672 -> 1792 x 1 of 8, down K=14336 -> 256 x 4 of 7."""
    block_k = max(MIN_SEG, min(STEP_BYTES, triton.next_power_of_2(k)))
    programs = triton.cdiv(n, BLOCK_N)
    steps = triton.cdiv(k, block_k)
    split = 1
    while (split < MAX_SPLIT_K and programs * split * 2 <= TARGET_PROGRAMS
           and steps // (2 * split) >= MIN_SPLIT_STEPS):
        split *= 2
    return Fp8GemvConfig(block_n=BLOCK_N, block_k=block_k, split_k=split, use_dot=m > BROADCAST_MAX_M,
                         num_warps=4, num_stages=3, unroll=triton.cdiv(steps, split) <= MAX_UNROLL)


def _seg(cfg: Fp8GemvConfig, block: tuple[int, int] | None) -> int:
    """A step's segment: the largest power of two dividing the scale tile's width (at most BLOCK_K), so a
    segment never straddles two scale columns; for row scales all of the step. On tensor cores at most
    DOT_SEG: one dot's x operand [DOT_SEG, 16] stays in registers (512 spilled at 16 rows on sm_90)."""
    seg = cfg.block_k if block is None else min(cfg.block_k, block[1] & -block[1])
    return min(seg, DOT_SEG) if cfg.use_dot else seg


def split_plan(k: int, cfg: Fp8GemvConfig) -> tuple[int, int]:
    """(K_SPLIT, splits): each split's K range, whole steps, and how many ranges cover K (<= cfg.split_k)."""
    steps = triton.cdiv(k, cfg.block_k)
    k_split = triton.cdiv(steps, max(1, cfg.split_k)) * cfg.block_k
    return k_split, triton.cdiv(k, k_split)


# ---------------------------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def _w_step(w_ptr, k0, n_offs, n_mask, stride_wn, K: tl.constexpr, BLOCK_K: tl.constexpr, SEG: tl.constexpr):
    """w8 [T, BLOCK_N, SEG] for the step at k0: segment t holds w8[n, k0 + t * SEG : k0 + (t + 1) * SEG]."""
    T: tl.constexpr = BLOCK_K // SEG
    t = tl.arange(0, T)
    j = tl.arange(0, SEG)
    ks = k0 + t[:, None, None] * SEG + j[None, None, :]
    return tl.load(w_ptr + n_offs[None, :, None] * stride_wn + ks,
                   mask=n_mask[None, :, None] & (ks < K), other=0.0)


@triton.jit
def _step_mac(acc, w, k0, x_ptr, res_ptr, norm_w_ptr, rstd, s_ptr, n_offs, n_mask, M, stride_xm, stride_rm,
              stride_sn, K: tl.constexpr, PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr,
              TILE_SCALES: tl.constexpr, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SEG: tl.constexpr, USE_DOT: tl.constexpr,
              DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] += sum over the step's segments of scale(segment) * w_segment @ a_segment.T, where
    a = prologue(x) (gemv.py's: x itself, add + RMSNorm with rstd [BLOCK_M], or SiLU-mul of [gate | up])."""
    T: tl.constexpr = BLOCK_K // SEG
    t = tl.arange(0, T)
    j = tl.arange(0, SEG)
    rows = tl.arange(0, BLOCK_M)
    ks = k0 + t[:, None] * SEG + j[None, :]                                        # [T, SEG]
    k_mask = ks < K
    norm_w = tl.zeros([T, SEG], tl.float32)   # read only by the RMSNorm prologue
    if PROLOGUE == PROLOGUE_RMS:
        norm_w = tl.load(norm_w_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)   # [T, SEG]
    if USE_DOT:
        mask = k_mask[:, :, None] & (rows[None, None, :] < M)
        a = _activation(x_ptr, res_ptr, rows[None, None, :] * stride_xm + ks[:, :, None],
                        rows[None, None, :] * stride_rm + ks[:, :, None], mask, norm_w[:, :, None],
                        rstd[None, None, :], K, PROLOGUE, HAS_RES)                   # [T, SEG, BLOCK_M]
        if DOT_FP32:   # Triton's interpreter gets bf16 dots wrong
            a = a.to(tl.float32)
        part = tl.dot(w.to(a.dtype), a, input_precision=DOT_PRECISION)        # FP8 -> x's dtype is exact
    else:
        wf = w.to(tl.float32)
        part = tl.zeros([T, BLOCK_N, BLOCK_M], tl.float32)
        for m in tl.static_range(BLOCK_M):
            rstd_m = tl.sum(tl.where(rows == m, rstd, 0.0), 0)                      # this row's rstd
            a = _activation(x_ptr, res_ptr, m * stride_xm + ks, m * stride_rm + ks, k_mask & (m < M), norm_w,
                            rstd_m, K, PROLOGUE, HAS_RES).to(tl.float32)
            p = tl.sum(wf * a[:, None, :], 2)                                        # [T, BLOCK_N]
            part += tl.where(rows[None, None, :] == m, p[:, :, None], 0.0)
    if TILE_SCALES:   # one scale per (row, segment): the segment lies in tile column k_seg // SCALE_BK
        k_seg = k0 + t * SEG
        s = tl.load(s_ptr + (n_offs // SCALE_BN)[None, :] * stride_sn + (k_seg // SCALE_BK)[:, None],
                    mask=n_mask[None, :] & (k_seg < K)[:, None], other=0.0)          # [T, BLOCK_N]
        part = part * s[:, :, None]
    return acc + tl.sum(part, 0)


@triton.jit
def _fp8_gemv_kernel(x_ptr, res_ptr, norm_w_ptr, res_out_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, M, N, stride_xm,
                     stride_rm, stride_rom, stride_wn, stride_sn, stride_om, stride_os, eps,
                     K: tl.constexpr, K_SPLIT: tl.constexpr, PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr,
                     TILE_SCALES: tl.constexpr,
                     SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr, HAS_BIAS: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SEG: tl.constexpr,
                     USE_DOT: tl.constexpr, UNROLL: tl.constexpr, PARTIAL: tl.constexpr,
                     DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr):
    """Program (pid_n, split): rows pid_n * BLOCK_N.., K range split * K_SPLIT.. (module docstring). PARTIAL:
    out_ptr is the float32 workspace [splits, M, N] (stride_os between splits), bias and rounding left to
    _split_sum_kernel; otherwise the final [M, N] in x's dtype. PROLOGUE (gemv.py's): the matmul's input is x,
    RMSNorm(x + residual) (rstd from a first pass over the rows; program (0, 0) stores x + residual to res_out) or
    SiLU(gate) * up of x = [gate | up] (K is then the width of one half)."""
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    n_offs = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n_offs < N
    k_lo = split * K_SPLIT
    STEPS: tl.constexpr = K_SPLIT // BLOCK_K
    # the first step's weights do not depend on the kernel before this one: read them while it finishes
    w = _w_step(w_ptr, k_lo, n_offs, n_mask, stride_wn, K, BLOCK_K, SEG)
    pdl_wait(USE_PDL)
    rstd = tl.zeros([BLOCK_M], tl.float32)
    if PROLOGUE == PROLOGUE_RMS:
        rstd = _row_rstd(x_ptr, res_ptr, res_out_ptr, pid_n + split, M, stride_xm, stride_rm, stride_rom, eps,
                         K, HAS_RES, BLOCK_M, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    acc = _step_mac(acc, w, k_lo, x_ptr, res_ptr, norm_w_ptr, rstd, s_ptr, n_offs, n_mask, M, stride_xm, stride_rm,
                    stride_sn, K, PROLOGUE, HAS_RES, TILE_SCALES, SCALE_BN, SCALE_BK, BLOCK_M, BLOCK_N, BLOCK_K, SEG,
                    USE_DOT, DOT_FP32, DOT_PRECISION)
    if UNROLL:
        for i in tl.static_range(1, STEPS):
            k0 = k_lo + i * BLOCK_K
            w = _w_step(w_ptr, k0, n_offs, n_mask, stride_wn, K, BLOCK_K, SEG)
            acc = _step_mac(acc, w, k0, x_ptr, res_ptr, norm_w_ptr, rstd, s_ptr, n_offs, n_mask, M, stride_xm,
                            stride_rm, stride_sn, K, PROLOGUE, HAS_RES, TILE_SCALES, SCALE_BN, SCALE_BK, BLOCK_M,
                            BLOCK_N, BLOCK_K, SEG, USE_DOT, DOT_FP32, DOT_PRECISION)
    else:
        for i in range(1, STEPS):
            k0 = k_lo + i * BLOCK_K
            w = _w_step(w_ptr, k0, n_offs, n_mask, stride_wn, K, BLOCK_K, SEG)
            acc = _step_mac(acc, w, k0, x_ptr, res_ptr, norm_w_ptr, rstd, s_ptr, n_offs, n_mask, M, stride_xm,
                            stride_rm, stride_sn, K, PROLOGUE, HAS_RES, TILE_SCALES, SCALE_BN, SCALE_BK, BLOCK_M,
                            BLOCK_N, BLOCK_K, SEG, USE_DOT, DOT_FP32, DOT_PRECISION)
    if not TILE_SCALES:   # one scale per output row
        acc = acc * tl.load(s_ptr + n_offs * stride_sn, mask=n_mask, other=0.0)[:, None]
    rows = tl.arange(0, BLOCK_M)
    mask = n_mask[:, None] & (rows[None, :] < M)
    offs = rows[None, :] * stride_om + n_offs[:, None]
    if PARTIAL:
        tl.store(out_ptr + split * stride_os + offs, acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + n_offs, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _split_sum_kernel(ws_ptr, bias_ptr, out_ptr, N, stride_ws, stride_wm, stride_om, SPLITS: tl.constexpr,
                      HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """out[m, n] = sum over splits of ws[s, m, n] (in split order) + bias[n], rounded once to out's dtype."""
    row = tl.program_id(1)
    n_offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    n_mask = n_offs < N
    acc = tl.zeros([BLOCK], tl.float32)
    if HAS_BIAS:   # a weight: read before the wait
        acc += tl.load(bias_ptr + n_offs, mask=n_mask, other=0.0).to(tl.float32)
    pdl_wait(USE_PDL)
    total = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLITS):
        total += tl.load(ws_ptr + s * stride_ws + row * stride_wm + n_offs, mask=n_mask, other=0.0)
    tl.store(out_ptr + row * stride_om + n_offs, (total + acc).to(out_ptr.dtype.element_ty), mask=n_mask)


# ---------------------------------------------------------------------------------------------------------------
# launcher
# ---------------------------------------------------------------------------------------------------------------

SUM_BLOCK = 1024   # outputs per program of _split_sum_kernel


def fp8_gemv(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None,
             bias: torch.Tensor | None = None, config: Fp8GemvConfig | None = None) -> torch.Tensor:
    """Triton twin of fp8_gemv_ref: x [M <= 16, K] (unit last stride), w8 [N, K] float8_e4m3fn, scale [N, 1]
    (row) or [ceil(N / bn), ceil(K / bk)] with block=(bn, bk) float32, bias [N] -> [M, N] in x's dtype."""
    return _launch(PROLOGUE_NONE.value, x, None, None, 0.0, w8, scale, block, bias, x.shape[1], config)[0]


def fp8_add_rms_norm_gemv(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                          w8: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None,
                          bias: torch.Tensor | None = None, config: Fp8GemvConfig | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Twin of gemv.add_rms_norm_gemv_ref with FP8 weights: (rms_norm(x + residual) @ W.T [M, N], x + residual);
    with residual None the second result is x itself. One launch (plus the split sum) instead of a norm kernel and
    a matmul."""
    k = x.shape[1]
    assert norm_weight.shape == (k,) and norm_weight.dtype == x.dtype, f"norm_weight {tuple(norm_weight.shape)}"
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(-1) == 1, "residual"
    out, res_out = _launch(PROLOGUE_RMS.value, x, residual, norm_weight, eps, w8, scale, block, bias, k, config)
    return out, (res_out if residual is not None else x)


def fp8_silu_mul_gemv(gate_up: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor,
                      block: tuple[int, int] | None = None, bias: torch.Tensor | None = None,
                      config: Fp8GemvConfig | None = None) -> torch.Tensor:
    """Twin of gemv.silu_mul_gemv_ref with FP8 weights: gate_up [M <= 16, 2I] = [gate | up], w8 [N, I]."""
    width = gate_up.shape[1]
    assert width % 2 == 0, f"gate_up width {width} is not even"
    return _launch(PROLOGUE_SILU.value, gate_up, None, None, 0.0, w8, scale, block, bias, width // 2, config)[0]


def fp8_add_rms_norm_gemv_ref(x, residual, norm_weight, eps, w8, scale, block=None, bias=None):
    """The references of the folded launchers: gemv.py's, on the dequantized weights."""
    return add_rms_norm_gemv_ref(x, residual, norm_weight, eps, dequantize(w8, scale, block).to(x.dtype), bias)


def fp8_silu_mul_gemv_ref(gate_up, w8, scale, block=None, bias=None):
    return silu_mul_gemv_ref(gate_up, dequantize(w8, scale, block).to(gate_up.dtype), bias)


def _launch(prologue: int, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor | None,
            eps: float, w8: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
            bias: torch.Tensor | None, k: int, config: Fp8GemvConfig | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    m = x.shape[0]
    n = w8.shape[0]
    _check_operands(x, w8, scale, block, bias, k)
    cfg = config or default_config(m, n, k)
    seg = _seg(cfg, block)
    assert cfg.block_k & (cfg.block_k - 1) == 0 and seg >= MIN_SEG, f"{cfg}: block_k a power of two, segment {seg}"
    assert not cfg.use_dot or cfg.block_n >= DOT_BLOCK_M, f"{cfg}: tl.dot needs block_n >= {DOT_BLOCK_M}"
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    with_res = residual is not None
    res_out = torch.empty(m, k, dtype=x.dtype, device=x.device) if with_res else None
    if m == 0 or n == 0:
        return out, res_out
    res, ro = (residual, res_out) if with_res else (x, out)     # unused by the kernel without a residual
    k_split, splits = split_plan(k, cfg)
    partial = splits > 1
    # split-K: float32 partial sums [splits, M, N]; torch.empty is a caching-allocator block (graph-safe)
    dest = torch.empty(splits, m, n, dtype=torch.float32, device=x.device) if partial else out
    opts = launch_options(x.device)
    _fp8_gemv_kernel[(triton.cdiv(n, cfg.block_n), splits)](
        x, res, norm_weight if norm_weight is not None else x, ro, w8, scale, bias if bias is not None else scale,
        dest, m, n, x.stride(0), res.stride(0), ro.stride(0), w8.stride(0), scale.stride(0),
        dest.stride(-2), dest.stride(0) if partial else 0, eps,
        K=k, K_SPLIT=k_split, PROLOGUE=prologue, HAS_RES=with_res, TILE_SCALES=block is not None, SCALE_BN=block[0] if block else 1,
        SCALE_BK=block[1] if block else 1, HAS_BIAS=bias is not None,
        BLOCK_M=DOT_BLOCK_M if cfg.use_dot else triton.next_power_of_2(m), BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, SEG=seg, USE_DOT=cfg.use_dot, UNROLL=cfg.unroll, PARTIAL=partial,
        DOT_FP32=_interpreted() and x.dtype == torch.bfloat16,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",   # fp32 activations keep exact fp32 dots
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **opts)
    if partial:
        _split_sum_kernel[(triton.cdiv(n, SUM_BLOCK), m)](
            dest, bias if bias is not None else dest, out, n, dest.stride(0), dest.stride(1), out.stride(0),
            SPLITS=splits, HAS_BIAS=bias is not None, BLOCK=SUM_BLOCK, num_warps=4, **opts)
    return out, res_out


def _check_operands(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
                    bias: torch.Tensor | None, k: int) -> None:
    m = x.shape[0]
    n = w8.shape[0]
    assert m <= MAX_M, f"the FP8 skinny matmul serves M <= {MAX_M} rows, got {m}"
    assert w8.dtype == torch.float8_e4m3fn and w8.shape[1] == k, f"w8 {w8.dtype} {tuple(w8.shape)} vs K={k}"
    assert x.stride(-1) == 1 and w8.stride(-1) == 1, "x and w8 need a unit last stride"
    assert scale.dtype == torch.float32 and scale.stride(-1) == 1, "scales: float32, unit last stride"
    if block is None:
        assert scale.shape == (n, 1), f"row scales must be [{n}, 1], got {tuple(scale.shape)}"
    else:
        assert block[1] % MIN_SEG == 0, f"tile width {block[1]} is not a multiple of {MIN_SEG}"
        assert scale.shape == (-(-n // block[0]), -(-k // block[1])), f"tile scales {tuple(scale.shape)}"
    if bias is not None:
        assert bias.shape == (n,) and bias.stride(0) == 1, f"bias must be contiguous [{n}]"


def _interpreted() -> bool:
    return bool(triton.knobs.runtime.interpret)
