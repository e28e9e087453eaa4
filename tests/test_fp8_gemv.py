"""The FP8 matmuls against plain torch: the Triton skinny kernel (under TRITON_INTERPRET=1, in a child process),
torch._scaled_mm with per-token activations (on the CPU), and the quantization arithmetic they share."""
from __future__ import annotations

import pytest
import torch

from kestrel.layers.fp8_quant import FP8, dequantize, quantize_per_block, quantize_per_row, quantize_per_tensor
from tests.triton_interpreter import INTERPRETED, run_file_under_interpreter
from tests.triton_interpreter import interpreted_only as interpreted_only_marker

interpreted_only = interpreted_only_marker("test_fp8_gemv_under_triton_interpreter")

N, K = 72, 200   # neither a multiple of the kernel's BLOCK_N (16) nor of the tiles below


def torch_reference(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, block, bias) -> torch.Tensor:
    """x @ (w8 * scale).T in float64, the scale expanded by indexing (not by the code under test)."""
    w = w8.double()
    if block is None:
        w = w * scale.double().reshape(-1, 1)
    else:
        rows = torch.arange(w.shape[0]) // block[0]
        cols = torch.arange(w.shape[1]) // block[1]
        w = w * scale.double()[rows][:, cols]
    out = x.double() @ w.T
    return out if bias is None else out + bias.double()


def operands(m: int, dtype: torch.dtype, block, seed: int, with_bias: bool):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, K, generator=g).to(dtype)
    w = torch.randn(N, K, generator=g) * 0.05
    w8, scale = quantize_per_row(w) if block is None else quantize_per_block(w, block)
    bias = torch.randn(N, generator=g).to(dtype) if with_bias else None
    return x, w8, scale, bias


@pytest.mark.skipif(INTERPRETED, reason="this is the interpreter child")
def test_fp8_gemv_under_triton_interpreter():
    run_file_under_interpreter(__file__)


@interpreted_only
@pytest.mark.parametrize("block", [None, (16, 32), (32, 64), (128, 128)], ids=str)
@pytest.mark.parametrize("dtype,m,with_bias", [(torch.float32, 1, False), (torch.float32, 3, True),
                                               (torch.bfloat16, 16, True), (torch.bfloat16, 5, False)])
def test_fp8_gemv_kernel_matches_torch(block, dtype, m, with_bias):
    from kestrel.kernels.triton.fp8_gemv import fp8_gemv, fp8_gemv_ref

    x, w8, scale, bias = operands(m, dtype, block, seed=m + (block[0] if block else 0), with_bias=with_bias)
    got = fp8_gemv(x, w8, scale, block, bias)
    assert got.dtype == dtype and got.shape == (m, N)
    want = torch_reference(x, w8, scale, block, bias)
    tol = 1e-4 if dtype == torch.float32 else 2e-2   # bf16: one rounding of outputs of magnitude ~1
    assert (got.double() - want).abs().max().item() < tol
    assert (fp8_gemv_ref(x, w8, scale, block, bias).double() - want).abs().max().item() < tol


def test_quantizers_keep_every_value_within_half_an_fp8_step():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 72, generator=g)
    for w8, scale, block in [(*quantize_per_row(w), None), (*quantize_per_tensor(w), None),
                             (*quantize_per_block(w, (16, 32)), (16, 32))]:
        assert w8.dtype == FP8 and scale.dtype == torch.float32
        back = dequantize(w8, scale, block)
        # E4M3 keeps 3 mantissa bits: relative error at most 2^-4 for values in the normal range
        assert ((back - w).abs() <= w.abs() / 16 + 1e-6).all()
    _, row_scale = quantize_per_row(w)
    assert row_scale.shape == (40, 1)
    _, tile_scale = quantize_per_block(w, (16, 32))
    assert tile_scale.shape == (3, 3)   # ceil(40 / 16), ceil(72 / 32)
    assert quantize_per_tensor(w)[1].shape == ()


@pytest.mark.parametrize("with_bias", [False, True])
def test_scaled_mm_path_matches_the_dequantized_reference(with_bias):
    """The prefill-size CUDA path (per-token FP8 activations, torch._scaled_mm with row scales) on the CPU: within
    the activation quantization's error of the float reference."""
    from kestrel.layers.fp8 import scaled_mm_linear

    g = torch.Generator().manual_seed(1)
    x = torch.randn(33, 64, generator=g).to(torch.bfloat16)
    w8, scale = quantize_per_row(torch.randn(48, 64, generator=g) * 0.05)
    bias = torch.randn(48, generator=g).to(torch.bfloat16) if with_bias else None
    got = scaled_mm_linear(x, w8, scale, bias)
    want = torch_reference(x, w8, scale, None, bias)
    assert got.dtype == torch.bfloat16
    # x in FP8 per token: ~2^-4 relative per element, averaging over K = 64 terms
    assert ((got.double() - want).abs().max() / want.abs().max()).item() < 0.03
