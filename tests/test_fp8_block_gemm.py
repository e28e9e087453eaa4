"""The FP8 block-scaled matmul for M > 16 rows (kernels/triton/fp8_block_gemm.py) against a float64 reference that
expands the tile scales by indexing, under TRITON_INTERPRET=1 in a child process; and its config table."""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from kestrel.kernels.fp8_quant import quantize_per_block
from kestrel.kernels.triton.fp8_block_gemm import _round_to_e4m3
from tests.triton_interpreter import INTERPRETED, run_file_under_interpreter
from tests.triton_interpreter import interpreted_only as interpreted_only_marker

interpreted_only = interpreted_only_marker("test_fp8_block_gemm_under_triton_interpreter")

N, K = 80, 272   # neither a multiple of the tiles below nor of the kernel's blocks


def reference(x, w8, scale, block, bias) -> torch.Tensor:
    rows = torch.arange(w8.shape[0]) // block[0]
    cols = torch.arange(w8.shape[1]) // block[1]
    out = x.double() @ (w8.double() * scale.double()[rows][:, cols]).T
    return out if bias is None else out + bias.double()


@pytest.mark.slow   # a child pytest running the file's kernels in Triton's interpreter
@pytest.mark.skipif(INTERPRETED, reason="this is the interpreter child")
def test_fp8_block_gemm_under_triton_interpreter():
    run_file_under_interpreter(__file__, min_passed=21)   # all but the ones that skip in the child


@interpreted_only
@pytest.mark.parametrize("block", [(16, 32), (32, 64), (128, 128)], ids=str)
@pytest.mark.parametrize("m,with_bias,split_k", [(17, True, 1), (40, False, 1), (130, True, 1), (33, False, 3)])
def test_fp8_block_gemm_matches_the_reference(block, m, with_bias, split_k):
    from dataclasses import replace

    from kestrel.kernels.triton.fp8_block_gemm import default_config, fp8_block_gemm

    g = torch.Generator().manual_seed(m + block[0])
    x = torch.randn(m, K, generator=g).to(torch.bfloat16)
    w8, scale = quantize_per_block(torch.randn(N, K, generator=g) * 0.05, block)
    bias = torch.randn(N, generator=g).to(torch.bfloat16) if with_bias else None
    cfg = replace(default_config(m, N, K, block), split_k=split_k)   # split 3: K's steps do not split evenly
    got = fp8_block_gemm(x, w8, scale, block, bias, config=cfg)
    assert got.dtype == torch.bfloat16 and got.shape == (m, N)
    want = reference(x, w8, scale, block, bias)
    # one bf16 rounding of the output (the interpreter truncates: under 1 ulp, 2^-7 relative); float32 sums
    assert ((got.double() - want).abs() <= want.abs() * 2 ** -7 + 1e-3).all()


@interpreted_only
@pytest.mark.parametrize("block", [(16, 32), (128, 128)], ids=str)
@pytest.mark.parametrize("m,with_bias,split_k", [(17, True, 1), (130, False, 1), (33, True, 3)])
def test_w8a8_block_gemm_matches_its_reference(block, m, with_bias, split_k):
    """W8A8: x quantized per row in groups of the tile width inside the kernel, FP8 x FP8 products; against
    fp8_w8a8_ref (the same quantization in torch) to one output rounding, and against the bf16-activation product
    within FP8's activation error (stated: 2^-4 of each group's largest value, summed in quadrature over K)."""
    from dataclasses import replace

    from kestrel.kernels.fp8_quant import fp8_w8a8_ref
    from kestrel.kernels.triton.fp8_block_gemm import fp8_block_gemm, w8a8_config

    g = torch.Generator().manual_seed(m + block[1])
    x = torch.randn(m, K, generator=g).to(torch.bfloat16)
    x[3, :] = 0   # an all-zero row: its groups' scales stay finite, its outputs are the bias
    w8, scale = quantize_per_block(torch.randn(N, K, generator=g) * 0.05, block)
    bias = torch.randn(N, generator=g).to(torch.bfloat16) if with_bias else None
    cfg = replace(w8a8_config(m, N, K, block), split_k=split_k)
    got = fp8_block_gemm(x, w8, scale, block, bias, config=cfg, quantize_x=True)
    assert got.dtype == torch.bfloat16 and got.shape == (m, N)
    want = fp8_w8a8_ref(x, w8, scale, block, bias).double()
    assert ((got.double() - want).abs() <= want.abs() * 2 ** -7 + 1e-3).all()
    exact = reference(x, w8, scale, block, bias)
    rel = (got.double() - exact).norm() / exact.norm()
    assert rel < 2 ** -4, rel   # FP8 activations: E4M3's 3 mantissa bits, errors averaging over K


@triton.jit
def _rounding_kernel(v_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, _round_to_e4m3(tl.load(v_ptr + offs, mask=offs < n, other=0.0)), mask=offs < n)


@interpreted_only
def test_interpreter_rounding_to_e4m3_is_torchs():
    """The arithmetic rounding the interpreted W8A8 kernel uses equals torch's float32 -> E4M3 cast (RTNE) on
    every E4M3 value, every midpoint between neighbours (ties), and random values across the range."""
    kernel = _rounding_kernel
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[grid.isfinite()].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    v = torch.cat([grid, mids, torch.empty(4000).uniform_(-448, 448, generator=torch.Generator().manual_seed(0)),
                   torch.empty(1000).uniform_(-0.05, 0.05, generator=torch.Generator().manual_seed(1))])
    out = torch.empty_like(v)
    kernel[(triton.cdiv(v.numel(), 1024),)](v, out, v.numel(), BLOCK=1024)
    assert torch.equal(out, v.to(torch.float8_e4m3fn).float())


@interpreted_only
def test_fp8_block_gemm_of_no_rows_and_fp16():
    from kestrel.kernels.triton.fp8_block_gemm import fp8_block_gemm

    w8, scale = quantize_per_block(torch.randn(N, K) * 0.05, (16, 16))
    assert fp8_block_gemm(torch.empty(0, K, dtype=torch.bfloat16), w8, scale, (16, 16)).shape == (0, N)
    x = torch.randn(20, K).half()
    want = reference(x, w8, scale, (16, 16), None)
    assert ((fp8_block_gemm(x, w8, scale, (16, 16)).double() - want).abs() <= want.abs() * 2 ** -10 + 1e-3).all()


def test_config_table_on_the_8b_layers():
    """Decode at 128 rows: split-K where the output tiles are under one H100 wave (o, down); prefill chunks
    (thousands of rows) never split. The tile always divides the 128 x 128 scale tile."""
    from kestrel.kernels.triton.fp8_block_gemm import TARGET_PROGRAMS, default_config

    layers = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
    for name, (n, k) in layers.items():
        for m in (17, 64, 128, 2048):
            cfg = default_config(m, n, k, (128, 128))
            assert 128 % cfg.block_n == 0 and 128 % cfg.block_k == 0
            tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
            assert cfg.split_k == 1 or tiles * cfg.split_k <= TARGET_PROGRAMS, (name, m, cfg)
            assert k // (cfg.block_k * cfg.split_k) >= 4, (name, m, cfg)
        assert default_config(2048, n, k, (128, 128)).split_k == 1
    assert default_config(128, 4096, 14336, (128, 128)).split_k > 1   # down at c128: 32 tiles alone


@pytest.mark.skipif(INTERPRETED, reason="compiles; nothing to interpret")
@pytest.mark.parametrize("m,n,k", [(128, 4096, 14336), (17, 6144, 4096), (2048, 28672, 4096)], ids=str)
def test_table_configs_build_for_sm90_on_the_tensor_cores(m, n, k):
    """Each config the table picks for an 8B layer compiles for Hopper with Triton's own ptxas, on MMA."""
    import triton

    from kestrel.kernels.triton.fp8_block_gemm import _fp8_block_gemm_kernel, default_config
    from tests.sm90 import compile_for_sm90

    cfg = default_config(m, n, k, (128, 128))
    steps = triton.cdiv(k, cfg.block_k)
    per_split = triton.cdiv(steps, cfg.split_k)
    partial = triton.cdiv(steps, per_split) > 1
    constexprs = dict(K_SPLIT=per_split * cfg.block_k, SCALE_BN=128, SCALE_BK=128, HAS_BIAS=False, PARTIAL=partial,
                      BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, DOT_FP32=False, USE_PDL=True)
    types = {"w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "bias_ptr": "*fp32", "out_ptr": "*fp32" if partial else "*bf16"}
    ptx = compile_for_sm90(_fp8_block_gemm_kernel, constexprs, types,
                           dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    assert "mma" in ptx and "griddepcontrol.wait" in ptx


@pytest.mark.skipif(INTERPRETED, reason="compiles; nothing to interpret")
@pytest.mark.parametrize("m,n,k", [(128, 4096, 14336), (256, 6144, 4096)], ids=str)
def test_w8a8_configs_run_fp8_on_hoppers_tensor_cores(m, n, k):
    """The W8A8 kernel compiles for sm90 to FP8 wgmma (e4m3 x e4m3), not to a widened bf16 product."""
    import triton

    from kestrel.kernels.triton.fp8_block_gemm import _fp8_block_gemm_kernel, w8a8_config
    from tests.sm90 import compile_for_sm90

    cfg = w8a8_config(m, n, k, (128, 128))
    steps = triton.cdiv(k, cfg.block_k)
    per_split = triton.cdiv(steps, cfg.split_k)
    partial = triton.cdiv(steps, per_split) > 1
    constexprs = dict(K_SPLIT=per_split * cfg.block_k, SCALE_BN=128, SCALE_BK=128, HAS_BIAS=False, PARTIAL=partial,
                      BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, DOT_FP32=False, USE_PDL=True,
                      QUANT_X=True)
    types = {"w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "bias_ptr": "*fp32", "out_ptr": "*fp32" if partial else "*bf16"}
    ptx = compile_for_sm90(_fp8_block_gemm_kernel, constexprs, types,
                           dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    assert "wgmma" in ptx and "e4m3.e4m3" in ptx
