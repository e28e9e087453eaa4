"""FP8 skinny matmul for decode: out = x @ (w8 * scale).T for a handful of rows, reading one byte per weight.

At batch sizes 1..16 a linear layer is a weight read (kernels/triton/gemv.py); FP8 weights halve the bytes. Each
program owns BLOCK_N output rows and walks all of K, as the bf16 kernel's broadcast path does:

    w8 tile [BLOCK_N, BLOCK_K] (1 byte each) -> float32 ─┐
    x rows [M, BLOCK_K] (the model dtype)  -> float32 ──┴► acc [BLOCK_N, BLOCK_M] += per row m: sum(w * x_m, 1)

Where the scales go:
  - row scales [N, 1] (per channel; a per-tensor checkpoint's scalars written into their rows): in the epilogue,
    acc[n, :] *= scale[n], one multiply per output.
  - tile scales [ceil(N / bn), ceil(K / bk)] (DeepSeek-V3 / Qwen3-FP8 blocks): BLOCK_K divides bk, so one K step
    lies inside one tile column and its partial sums take one scale per row: acc += part * scale[n // bn, k0 // bk].

The numerics are fp8_gemv_ref's: float32 products and accumulation of the exactly dequantized weight, bias added in
float32, one rounding to x's dtype. No autotuning at call time (CUDA-graph capturable); the fixed block sizes
are a first choice, to be measured on the GPU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.layers.fp8_quant import dequantize

MAX_M = 16
BLOCK_N = 16
BLOCK_K = 128


def fp8_gemv_ref(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ dequantize(w8, scale, block).T (+ bias) in float32, rounded once to x's dtype."""
    out = x.float() @ dequantize(w8, scale, block).T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, M, N, stride_xm, stride_wn, stride_sn, stride_om,
                     K: tl.constexpr, TILE_SCALES: tl.constexpr, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr,
                     HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    n_offs = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n_offs < N
    rows = tl.arange(0, BLOCK_M)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        w = tl.load(w_ptr + n_offs[:, None] * stride_wn + ks[None, :], mask=n_mask[:, None] & k_mask[None, :],
                    other=0.0).to(tl.float32)
        step = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        for m in tl.static_range(BLOCK_M):
            a = tl.load(x_ptr + m * stride_xm + ks, mask=k_mask & (m < M), other=0.0).to(tl.float32)
            part = tl.sum(w * a[None, :], 1)                                   # [BLOCK_N]
            step += tl.where(rows[None, :] == m, part[:, None], 0.0)
        if TILE_SCALES:   # this K step lies in tile column k0 // SCALE_BK (BLOCK_K divides SCALE_BK)
            s = tl.load(s_ptr + (n_offs // SCALE_BN) * stride_sn + k0 // SCALE_BK, mask=n_mask, other=0.0)
            step = step * s[:, None]
        acc += step
    if not TILE_SCALES:   # one scale per output row
        acc = acc * tl.load(s_ptr + n_offs * stride_sn, mask=n_mask, other=0.0)[:, None]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n_offs, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + rows[None, :] * stride_om + n_offs[:, None], acc.to(out_ptr.dtype.element_ty),
             mask=n_mask[:, None] & (rows[None, :] < M))


def block_k_for(block: tuple[int, int] | None) -> int:
    """The K step: BLOCK_K, or the largest power of two dividing the tile width, so a step never straddles tiles."""
    if block is None:
        return BLOCK_K
    bk = block[1]
    step = bk & -bk   # largest power of two dividing bk
    return max(16, min(BLOCK_K, step))


def fp8_gemv(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None,
             bias: torch.Tensor | None = None) -> torch.Tensor:
    """Triton twin of fp8_gemv_ref: x [M <= 16, K] (unit last stride), w8 [N, K] float8_e4m3fn, scale [N, 1]
    (row) or [ceil(N / bn), ceil(K / bk)] with block=(bn, bk) float32, bias [N] -> [M, N] in x's dtype."""
    m, k = x.shape
    n = w8.shape[0]
    assert m <= MAX_M, f"the FP8 skinny matmul serves M <= {MAX_M} rows, got {m}"
    assert w8.dtype == torch.float8_e4m3fn and w8.shape[1] == k, f"w8 {w8.dtype} {tuple(w8.shape)} vs K={k}"
    assert x.stride(-1) == 1 and w8.stride(-1) == 1, "x and w8 need a unit last stride"
    assert scale.dtype == torch.float32 and scale.stride(-1) == 1, "scales: float32, unit last stride"
    block_k = block_k_for(block)
    if block is None:
        assert scale.shape == (n, 1), f"row scales must be [{n}, 1], got {tuple(scale.shape)}"
    else:
        assert block[1] % block_k == 0, f"tile width {block[1]} is not a multiple of 16"
        assert scale.shape == (-(-n // block[0]), -(-k // block[1])), f"tile scales {tuple(scale.shape)}"
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    _fp8_gemv_kernel[(triton.cdiv(n, BLOCK_N),)](
        x, w8, scale, bias if bias is not None else scale, out, m, n, x.stride(0), w8.stride(0), scale.stride(0),
        out.stride(0), K=k, TILE_SCALES=block is not None, SCALE_BN=block[0] if block else 1,
        SCALE_BK=block[1] if block else 1, HAS_BIAS=bias is not None, BLOCK_M=triton.next_power_of_2(m),
        BLOCK_N=BLOCK_N, BLOCK_K=block_k)
    return out
