"""FP8 block-scaled matmul for many rows: out = x @ (w8 * scale).T, x of M > 16 rows (prefill chunks, decode at
high concurrency), weights read as FP8 and widened to x's dtype in registers (W8A16).

The weights stay one byte an element in HBM; each program widens its tile to bf16 (exact: every E4M3 value is a
bf16 value) and runs the tensor cores in bf16, so the FLOPs are bf16's and the weight bytes half of them. Decode at
128 concurrent is still a weight read (128 FLOPs per weight byte is under the H100's ridge), where half the bytes
count; a long prefill is compute-bound, where this runs at bf16's speed (FP8 activations would double the FLOPs,
at the cost of quantizing x: future work).

The scale tiles (bn x bk, 128 x 128 in DeepSeek-V3 / Qwen3-FP8 checkpoints) fix the program's tile: BLOCK_N
divides bn, BLOCK_K divides bk, so one program's step lies in one scale tile and takes one scalar:

                 K ->   | scale col 0 (bk) | scale col 1 | ...
             +----------+------------------+-------------+
    n0       | program  | step | step | .. | step | ..   |    acc[BLOCK_M, BLOCK_N] += dot(x, w_step.T) * s[n0 // bn, k // bk]
    n0+BN-1  | (pm, pn) |                  |             |    (float32 partial sums of one tile, scaled once)
             +----------+------------------+-------------+
    x rows   [m0, m0 + BLOCK_M) of [M, K], read per step

Split-K (few output tiles, long K: decode's o and down projections at 128 rows fill a third of the SMs otherwise):
the splits write float32 partial sums [SPLIT_K, M, N]; fp8_gemv's _split_sum_kernel adds them in a fixed order,
adds the bias and rounds once. Deterministic, no atomics; graph-capturable (no host syncs, a fixed config table).

Numerics: float32 products of x and the exact weight, float32 accumulation, the tile scale on each tile's partial
sum, bias in float32, one rounding to x's dtype: fp8_gemv_ref's, up to the summation order.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from kestrel.kernels.triton.fp8_gemv import SUM_BLOCK, _split_sum_kernel
from kestrel.kernels.triton.pdl import launch_options, pdl_wait

MIN_M = 17            # below this fp8_gemv serves (fp8.py routes by M)
FP8_MAX = tl.constexpr(448.0)    # E4M3's largest finite value
ACT_TINY = tl.constexpr(1e-12)   # an all-zero activation group still gets a scale that divides (fp8_quant._TINY)
TARGET_PROGRAMS = 132  # an H100's SMs: split K until the grid is about one wave


@dataclass(frozen=True)
class Fp8GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


def default_config(m: int, n: int, k: int, block: tuple[int, int]) -> Fp8GemmConfig:
    """A fixed table (no autotuning: graph capture and first calls stay cheap). Tiles as large as the scale tile
    allows; split-K doubles while the grid is under one wave and each split keeps >= 4 steps of K."""
    bn, bk = block
    block_m = 32 if m <= 32 else 64 if m <= 64 else 128
    block_n = min(128, _pow2_divisor(bn))
    block_k = min(128, _pow2_divisor(bk))
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    split = 1
    while tiles * split * 2 <= TARGET_PROGRAMS and k // (block_k * split * 2) >= 4:
        split *= 2
    warps = 8 if block_m * block_n >= 128 * 128 else 4
    return Fp8GemmConfig(block_m, block_n, block_k, split, warps, 3)


def w8a8_config(m: int, n: int, k: int, block: tuple[int, int]) -> Fp8GemmConfig:
    """The W8A8 kernel's table: the K step is the whole tile width (one activation group a step); rows as for
    W8A16; split-K under one wave as there."""
    base = default_config(m, n, k, block)
    return base if base.block_k == block[1] else replace(base, block_k=block[1])


def _pow2_divisor(x: int) -> int:
    """The largest power of two dividing x."""
    return x & -x


@triton.jit
def _fp8_block_gemm_kernel(x_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_sn,
                           stride_om, stride_os, K_SPLIT: tl.constexpr, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr,
                           HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr,
                           USE_PDL: tl.constexpr, QUANT_X: tl.constexpr = False):
    pid_m, pid_n, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    m_offs = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_offs = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_lane = tl.arange(0, BLOCK_K)
    m_mask, n_mask = m_offs < M, n_offs < N
    k_begin = pid_s * K_SPLIT
    s_row = (pid_n * BLOCK_N) // SCALE_BN   # BLOCK_N divides SCALE_BN: the whole tile shares a scale row
    pdl_wait(USE_PDL)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(0, K_SPLIT, BLOCK_K):   # the last split's steps past K load nothing and add zero
        k0 = k_begin + kk
        k_offs = k0 + k_lane
        k_mask = k_offs < K
        x = tl.load(x_ptr + m_offs[:, None] * stride_xm + k_offs[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0)
        w8 = tl.load(w_ptr + n_offs[:, None] * stride_wn + k_offs[None, :], mask=n_mask[:, None] & k_mask[None, :],
                     other=0.0)
        s = tl.load(s_ptr + s_row * stride_sn + k0 // SCALE_BK, mask=k0 < K, other=0.0)
        if QUANT_X:   # W8A8: this step's BLOCK_K columns of x are one group, quantized per row in registers
            xf = x.to(tl.float32)
            x_scale = tl.maximum(tl.max(tl.abs(xf), axis=1), ACT_TINY) / FP8_MAX
            xq = tl.clamp(xf / x_scale[:, None], -FP8_MAX, FP8_MAX)
            if DOT_FP32:   # the interpreter: the same FP8 values (rounded by arithmetic), multiplied in float32
                part = tl.dot(_round_to_e4m3(xq), tl.trans(w8.to(tl.float32)), input_precision="ieee")
            else:          # FP8 x FP8 on the tensor cores (wgmma e4m3 on Hopper), float32 sums
                part = tl.dot(xq.to(tl.float8e4nv), tl.trans(w8))
            acc += part * (x_scale[:, None] * s)
        else:
            if DOT_FP32:   # the interpreter has no bf16 dot: the same products in float32
                part = tl.dot(x.to(tl.float32), tl.trans(w8.to(tl.float32)), input_precision="ieee")
            else:
                part = tl.dot(x, tl.trans(w8.to(x.dtype)))
            acc += part * s
    out_offs = m_offs[:, None] * stride_om + n_offs[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if PARTIAL:
        tl.store(out_ptr + pid_s * stride_os + out_offs, acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + n_offs, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _round_to_e4m3(v):
    """v (float32, |v| <= 448) rounded to the nearest E4M3 value, ties to even, as float32: the interpreter's own
    float32 -> float8e4nv cast drops the carry when rounding reaches the next power of two (31.0 -> 16.0; Triton
    3.6), the GPU's cvt does not. A value's step is 2^(exponent - 3) (3 mantissa bits), 2^-9 below 2^-6
    (subnormals); adding and taking away 1.5 * 2^23 rounds v / step to an integer, ties to even, in float32."""
    a = tl.abs(v)
    exponent = tl.maximum(tl.floor(tl.log2(tl.where(a > 0, a, 1.0))), -6.0)
    step = tl.exp2(exponent - 3.0)
    magic = 12582912.0   # 1.5 * 2^23
    return ((v / step + magic) - magic) * step


def fp8_block_gemm(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                   bias: torch.Tensor | None = None, config: Fp8GemmConfig | None = None,
                   quantize_x: bool = False) -> torch.Tensor:
    """Triton twin of fp8_gemv_ref for any M: x [M, K] bf16/fp16 (unit last stride), w8 [N, K] float8_e4m3fn,
    scale [ceil(N / bn), ceil(K / bk)] float32, bias [N] -> [M, N] in x's dtype.

    quantize_x: W8A8 — x is quantized to E4M3 per row and per K group of bk columns (the weight's tile width:
    DeepSeek-V3's 1 x 128 activation groups beside 128 x 128 weight tiles) inside the kernel, and the tensor cores
    multiply FP8 by FP8 (twice bf16's rate on Hopper); fp8_w8a8_ref is its oracle."""
    m, k = x.shape
    n = w8.shape[0]
    _check_operands(x, w8, scale, block, bias)
    cfg = config or (w8a8_config(m, n, k, block) if quantize_x else default_config(m, n, k, block))
    assert block[0] % cfg.block_n == 0 and block[1] % cfg.block_k == 0, f"{cfg}: tiles must divide {block}"
    assert not quantize_x or cfg.block_k == block[1], f"W8A8 quantizes x in groups of the tile width {block[1]}"
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    steps = triton.cdiv(k, cfg.block_k)
    per_split = triton.cdiv(steps, cfg.split_k)
    splits = triton.cdiv(steps, per_split)   # every split covers whole steps, none is empty
    partial = splits > 1
    dest = torch.empty(splits, m, n, dtype=torch.float32, device=x.device) if partial else out
    opts = launch_options(x.device)
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), splits)
    _fp8_block_gemm_kernel[grid](
        x, w8, scale, bias if bias is not None else scale, dest, m, n, k, x.stride(0), w8.stride(0),
        scale.stride(0), dest.stride(-2), dest.stride(0) if partial else 0, per_split * cfg.block_k,
        SCALE_BN=block[0], SCALE_BK=block[1], HAS_BIAS=bias is not None, PARTIAL=partial,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        DOT_FP32=bool(triton.knobs.runtime.interpret), QUANT_X=quantize_x, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **opts)
    if partial:
        _split_sum_kernel[(triton.cdiv(n, SUM_BLOCK), m)](
            dest, bias if bias is not None else dest, out, n, dest.stride(0), dest.stride(1), out.stride(0),
            SPLITS=splits, HAS_BIAS=bias is not None, BLOCK=SUM_BLOCK, num_warps=4, **opts)
    return out


def _check_operands(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                    bias: torch.Tensor | None) -> None:
    m, k = x.shape
    n = w8.shape[0]
    assert x.dtype in (torch.bfloat16, torch.float16), f"x must be bf16 or fp16 (the tensor cores' input), got {x.dtype}"
    assert w8.dtype == torch.float8_e4m3fn and w8.shape[1] == k, f"w8 {w8.dtype} {tuple(w8.shape)} vs K={k}"
    assert x.stride(-1) == 1 and w8.stride(-1) == 1, "x and w8 need a unit last stride"
    assert scale.dtype == torch.float32 and scale.stride(-1) == 1, "scales: float32, unit last stride"
    assert scale.shape == (-(-n // block[0]), -(-k // block[1])), f"tile scales {tuple(scale.shape)}"
    assert _pow2_divisor(block[0]) >= 16 and _pow2_divisor(block[1]) >= 16, f"tiles {block}: need 16 | bn and bk"
    if bias is not None:
        assert bias.shape == (n,) and bias.stride(0) == 1, f"bias must be contiguous [{n}]"
