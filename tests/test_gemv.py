"""Skinny-matmul kernels (kestrel/kernels/triton/gemv.py) agree with their torch references; the references are the ops
they replace (fused_ops RMSNorm / SiLU-and-mul, then F.linear), bit for bit.

The kernels run on CPU in Triton's interpreter, in a child pytest started with TRITON_INTERPRET=1 (see
tests/test_triton_kernels.py for why and for the interpreter's gaps). Tolerances, per output element:
  - fp32: the kernel sums K products in another order than torch's GEMM: ~sqrt(K) * 2^-24 relative, far inside
    1e-5 of the largest output.
  - bf16: the output is rounded once (the interpreter truncates fp32->bf16 instead of rounding: up to one ulp),
    and the kernel's intermediates (x + residual, the normed row, silu(gate) * up) are rounded to bf16 too, where
    truncation or another fp32 summation order can land one ulp away in some elements; those add a random walk of
    ~sqrt(K) * ulp(a) * |w| to the output, well under an ulp of the output. So: two ulps of the largest output.
    A wrong index or a dropped tile is off by O(the output) and fails. Compiled kernels round like torch
    (tests/gpu/test_gemv_gpu.py holds them to bit equality for residual_out and mostly-bit-equal outputs).
Shapes are small and not multiples of the interpreter's tiles (N=72 over BLOCK_N=16, K=200 over BLOCK_K=64), so
partial tiles in both N and K are exercised; both product paths (broadcast FMAs, tl.dot) run at every M.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kestrel.kernels.triton import fused_ops, gemv
from tests.tolerances import assert_close_relative
from tests.triton_interpreter import INTERPRETED, run_file_under_interpreter
from tests.triton_interpreter import interpreted_only as interpreted_only_marker

interpreted_only = interpreted_only_marker("test_gemv_under_triton_interpreter")

N, K = 72, 200                                   # not multiples of the interpreter tiles (16 x 64)
PATHS = {"broadcast": gemv.GemvConfig(block_n=16, block_k=64, use_dot=False),
         "dot": gemv.GemvConfig(block_n=16, block_k=64, use_dot=True),
         "dot-fold4": gemv.GemvConfig(block_n=4, block_k=64, use_dot=True),   # K folded 4 ways (BLOCK_N < 16)
         # the whole-slice shape of config: all of K (200) in one masked step
         "broadcast-whole-k": gemv.GemvConfig(block_n=4, block_k=256, use_dot=False, num_warps=8)}


@pytest.mark.slow   # a child pytest running the file's kernels in Triton's interpreter
@pytest.mark.skipif(INTERPRETED, reason="this is the interpreter child")
def test_gemv_under_triton_interpreter():
    run_file_under_interpreter(__file__, min_passed=131)   # all but the ones that skip in the child


# ------------------------------------------------------------------------------------------------ helpers

def assert_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    """The module docstring's tolerances: fp32 1e-5 relative, 16-bit two ulps of the largest output."""
    assert got.dtype == want.dtype and got.shape == want.shape
    scale = want.float().abs().max().item() if want.numel() else 0.0
    if want.dtype == torch.float32:
        tol = dict(atol=1e-5 * scale, rtol=1e-5)
    else:
        eps = torch.finfo(want.dtype).eps
        tol = dict(atol=2 * eps * scale, rtol=eps)
    torch.testing.assert_close(got.float(), want.float(), **tol)


def assert_residual_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    """x + residual rounded to the model dtype: exact, except bf16 under the interpreter, which truncates (1 ulp)."""
    if want.dtype == torch.bfloat16 and INTERPRETED:
        eps = torch.finfo(torch.bfloat16).eps
        torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=eps)
    else:
        assert torch.equal(got, want)


def inputs(m: int, dtype: torch.dtype, seed: int, with_bias: bool = True, k: int = K, n: int = N,
           row_pad: int = 0) -> dict[str, torch.Tensor | None]:
    """Fresh random operands; x and residual are row slices of wider buffers when row_pad > 0 (row stride > K).

    Weights are scaled by 1/sqrt(K) so outputs stay O(1) whatever K is.
    """
    gen = torch.Generator().manual_seed(seed)
    wide = lambda cols: torch.randn(m, cols + row_pad, generator=gen).to(dtype)[:, :cols]   # noqa: E731
    return dict(
        x=wide(k), residual=wide(k), gate_up=wide(2 * k),
        norm_weight=(1 + 0.3 * torch.randn(k, generator=gen)).to(dtype),
        w=(torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype),
        bias=(0.5 * torch.randn(n, generator=gen)).to(dtype) if with_bias else None)


# ------------------------------------------------------------------------------------------------ references

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_add_rms_norm_gemv_ref_is_rms_norm_ref_then_linear(dtype, with_residual, with_bias):
    t = inputs(5, dtype, seed=1, with_bias=with_bias)
    residual = t["residual"] if with_residual else None
    out, res_out = gemv.add_rms_norm_gemv_ref(t["x"], residual, t["norm_weight"], 1e-6, t["w"], t["bias"])
    if with_residual:
        normed, want_res = fused_ops.rms_norm_ref(t["x"], t["norm_weight"], 1e-6, residual)
        assert torch.equal(res_out, want_res)
    else:
        normed = fused_ops.rms_norm_ref(t["x"], t["norm_weight"], 1e-6)
        assert res_out is t["x"]
    assert torch.equal(out, F.linear(normed, t["w"], t["bias"]))


def linear_by_hand(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """out[m, n] = sum_k x[m, k] * w[n, k] + bias[n], summed in float64 element by element (no GEMM, no F.linear),
    then rounded once to x's dtype: a reference that shares no code with the one under test."""
    out = (x.double()[:, None, :] * w.double()[None, :, :]).sum(-1)
    if bias is not None:
        out = out + bias.double()
    return out.to(x.dtype)


def ref_tolerance(dtype: torch.dtype) -> float:
    """fp32: another summation order, ~sqrt(K) * 2^-24 relative, far inside 1e-5 of the largest output; 16-bit:
    the output rounded once plus intermediates (silu(gate) * up) one ulp apart in some elements: two ulps."""
    return 1e-5 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_silu_mul_gemv_ref_is_silu_of_gate_times_up_then_linear(dtype, with_bias):
    """Against silu written out (g / (1 + e^-g)) on the first half times the second half, rounded to the model dtype
    as the unfused SiLU-and-mul is, then a by-hand linear: a swapped gate/up, a dropped bias or a wrong half fails
    by O(the output)."""
    t = inputs(5, dtype, seed=2, with_bias=with_bias)
    gate, up = t["gate_up"].double()[:, :K], t["gate_up"].double()[:, K:]
    act = (gate / (1 + torch.exp(-gate)) * up).to(dtype)
    want = linear_by_hand(act, t["w"], t["bias"])
    got = gemv.silu_mul_gemv_ref(t["gate_up"], t["w"], t["bias"])
    assert got.dtype == dtype
    assert_close_relative(got, want, ref_tolerance(dtype), f"silu_mul_gemv_ref {dtype}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_ref_is_linear(dtype, with_bias):
    """Against the by-hand float64 sum: a transposed weight, a dropped bias or a wrong output dtype fails."""
    t = inputs(3, dtype, seed=3, with_bias=with_bias)
    got = gemv.gemv_ref(t["x"], t["w"], t["bias"])
    assert got.dtype == dtype
    assert_close_relative(got, linear_by_hand(t["x"], t["w"], t["bias"]), ref_tolerance(dtype), f"gemv_ref {dtype}")


# ------------------------------------------------------------------------------------------------ launcher checks

def test_more_than_sixteen_rows_is_refused_with_a_pointer_to_cublas():
    t = inputs(17, torch.float32, seed=4)
    with pytest.raises(AssertionError, match="M <= 16"):
        gemv.gemv(t["x"], t["w"])
    with pytest.raises(AssertionError, match="M <= 16"):
        gemv.silu_mul_gemv(t["gate_up"], t["w"])


@pytest.mark.skipif(INTERPRETED, reason="the interpreter has its own small-tile config")
@pytest.mark.parametrize("n,k", [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072),
                                 (6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
@pytest.mark.parametrize("m", [1, 4, 8, 16])
def test_default_config_fills_the_gpu_and_tiles_k_evenly(n, k, m):
    cfg = gemv.default_config(m, n, k)
    assert -(-n // cfg.block_n) >= 128, "fewer programs than an H100/H200 has SMs"
    assert k % cfg.block_k == 0 or cfg.block_k >= k, "a masked K tail only where all of K is one step"
    assert cfg.use_dot == (m > gemv.BROADCAST_MAX_M)
    assert not cfg.unroll or k // cfg.block_k <= gemv.MAX_UNROLL


@pytest.mark.parametrize("n,k,blocks", [(4096, 1024, (16, 1024)), (6144, 1024, (16, 1024)),
                                         (1024, 2048, (4, 2048)), (1024, 3072, (4, 4096))])
def test_whole_slice_config_reads_each_programs_weights_in_one_step(n, k, blocks):
    """The whole-slice table (the Qwen3-0.6B shapes at one row): one K step, so every weight byte is read before
    the PDL wait; the same programs as the default table; 8 warps once the tile passes 8192 elements."""
    cfg = gemv.table_config(1, n, k, whole_slice=True)
    assert (cfg.block_n, cfg.block_k) == blocks and cfg.block_n == gemv.table_config(1, n, k).block_n
    assert cfg.num_warps == (8 if cfg.block_n * cfg.block_k > gemv.TILE_ELEMENTS else 4)
    assert gemv.table_config(1, 4096, 4096, whole_slice=True) == gemv.table_config(1, 4096, 4096)   # 8B: too big


@pytest.mark.skipif(INTERPRETED, reason="the interpreter has its own small-tile config")
def test_whole_slice_is_the_broadcast_paths_default():
    """Measured on the H200 at one row (0.852 -> 0.764 ms per 0.6B step): whole slices for M <= BROADCAST_MAX_M,
    K steps of ~TILE_ELEMENTS on the tensor-core path."""
    for m, whole in {1: True, 4: True, 8: False}.items():
        assert gemv.default_config(m, 4096, 1024) == gemv.table_config(m, 4096, 1024, whole_slice=whole)
    assert gemv.default_config(1, 4096, 1024).block_k == 1024   # qkv of the 0.6B: one step


# ------------------------------------------------------------------------------------------------ kernels

CASES = [  # (dtype, m, with_bias): each runs on both product paths
    (torch.float32, 1, False), (torch.float32, 3, True), (torch.float32, 16, True),
    (torch.bfloat16, 1, True), (torch.bfloat16, 3, False), (torch.bfloat16, 16, False),
]


@interpreted_only
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("dtype,m,with_bias", CASES)
def test_gemv_kernel_matches_reference(path, dtype, m, with_bias):
    t = inputs(m, dtype, seed=10 + m, with_bias=with_bias, row_pad=8 if m == 3 else 0)
    got = gemv.gemv(t["x"], t["w"], t["bias"], config=PATHS[path])
    assert_matches(got, gemv.gemv_ref(t["x"], t["w"], t["bias"]))


@interpreted_only
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("dtype,m,with_bias", CASES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_gemv_kernel_matches_reference(path, dtype, m, with_bias, with_residual):
    t = inputs(m, dtype, seed=20 + m, with_bias=with_bias, row_pad=8 if m == 3 else 0)
    residual = t["residual"] if with_residual else None
    out, res_out = gemv.add_rms_norm_gemv(t["x"], residual, t["norm_weight"], 1e-6, t["w"], t["bias"],
                                          config=PATHS[path])
    want, want_res = gemv.add_rms_norm_gemv_ref(t["x"], residual, t["norm_weight"], 1e-6, t["w"], t["bias"])
    assert_matches(out, want)
    if with_residual:
        assert res_out.shape == (m, K) and res_out.is_contiguous()
        assert_residual_matches(res_out, want_res)
    else:
        assert res_out is t["x"]


@interpreted_only
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("dtype,m,with_bias", CASES)
def test_silu_mul_gemv_kernel_matches_reference(path, dtype, m, with_bias):
    t = inputs(m, dtype, seed=30 + m, with_bias=with_bias, row_pad=8 if m == 3 else 0)
    got = gemv.silu_mul_gemv(t["gate_up"], t["w"], t["bias"], config=PATHS[path])
    assert_matches(got, gemv.silu_mul_gemv_ref(t["gate_up"], t["w"], t["bias"]))


@pytest.mark.parametrize("path,one_pass", [("broadcast", False), ("dot", False), ("dot-fold4", False),
                                           ("broadcast-whole-k", True)])
def test_add_rms_norm_reads_x_once_where_k_is_one_broadcast_tile(path, one_pass):
    """The whole-k broadcast path above runs the one-pass norm, the others two passes; both meet the reference."""
    assert gemv.one_pass_norm(PATHS[path], K) is one_pass


@interpreted_only
def test_fp16_residual_sum_is_exact_and_default_config_runs():
    """The interpreter rounds fp16 like torch, so the residual stream must come out bit-equal."""
    t = inputs(4, torch.float16, seed=40, k=96, n=40)
    out, res_out = gemv.add_rms_norm_gemv(t["x"], t["residual"], t["norm_weight"], 1e-5, t["w"], t["bias"])
    want, want_res = gemv.add_rms_norm_gemv_ref(t["x"], t["residual"], t["norm_weight"], 1e-5, t["w"], t["bias"])
    assert torch.equal(res_out, want_res)
    assert_matches(out, want)
    assert_matches(gemv.gemv(t["x"], t["w"]), gemv.gemv_ref(t["x"], t["w"]))
    assert_matches(gemv.silu_mul_gemv(t["gate_up"], t["w"]), gemv.silu_mul_gemv_ref(t["gate_up"], t["w"]))


@interpreted_only
def test_empty_batch_returns_empty_outputs():
    t = inputs(0, torch.float32, seed=41)
    assert gemv.gemv(t["x"], t["w"]).shape == (0, N)
    out, res_out = gemv.add_rms_norm_gemv(t["x"], t["residual"], t["norm_weight"], 1e-6, t["w"])
    assert out.shape == (0, N) and res_out.shape == (0, K)
