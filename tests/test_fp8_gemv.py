"""The FP8 matmuls against plain torch: the Triton skinny kernel (under TRITON_INTERPRET=1, in a child process),
torch._scaled_mm with per-token activations (on the CPU), and the quantization arithmetic they share."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kestrel.kernels.fp8_quant import FP8, dequantize, quantize_per_block, quantize_per_row, quantize_per_tensor
from tests.tolerances import assert_close_scaled
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


@pytest.mark.slow   # a child pytest running the file's kernels in Triton's interpreter
@pytest.mark.skipif(INTERPRETED, reason="this is the interpreter child")
def test_fp8_gemv_under_triton_interpreter():
    run_file_under_interpreter(__file__, min_passed=144)   # all but the ones that skip in the child


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
    assert_close_scaled(got, want, tol, "kernel")
    assert_close_scaled(fp8_gemv_ref(x, w8, scale, block, bias), want, tol, "fp8_gemv_ref")


def _fp8_gemv_configs():
    """Every road of fp8_gemv.py at the test shape (K=200: 4 steps of 64, 2 of 128, 1 masked step of 256)."""
    from kestrel.kernels.triton.fp8_gemv import Fp8GemvConfig

    return {
        "default": None,                                                              # interpreter: split 2
        "broadcast": Fp8GemvConfig(block_n=16, block_k=64),                           # pipelined range loop
        "broadcast-split3-unrolled": Fp8GemvConfig(block_n=16, block_k=64, split_k=3, unroll=True),  # 2 splits
        "broadcast-wide-step": Fp8GemvConfig(block_n=8, block_k=256, num_warps=8),  # K in one masked step
        "broadcast-split4": Fp8GemvConfig(block_n=32, block_k=32, split_k=4),       # 4 splits of 2 steps
        "dot": Fp8GemvConfig(block_n=16, block_k=64, use_dot=True),
        "dot-split2-unrolled": Fp8GemvConfig(block_n=32, block_k=128, split_k=2, use_dot=True, unroll=True),
    }


FP8_GEMV_CASES = [(torch.float32, 1, True), (torch.bfloat16, 3, False), (torch.bfloat16, 16, True)]


@interpreted_only
@pytest.mark.parametrize("block", [None, (16, 32), (32, 48), (128, 128)], ids=str)
@pytest.mark.parametrize("road", list(_fp8_gemv_configs()))
@pytest.mark.parametrize("dtype,m,with_bias", FP8_GEMV_CASES, ids=lambda v: str(v).replace("torch.", ""))
def test_fp8_gemv_configs_match_the_reference(road, block, dtype, m, with_bias):
    """Each config road (split-K on and off, unrolled and pipelined, broadcast and tensor cores, steps wider than
    the scale tile: (32, 48) takes 16-wide segments) on fresh inputs against fp8_gemv_ref."""
    from kestrel.kernels.triton.fp8_gemv import fp8_gemv, fp8_gemv_ref

    seed = 1000 + 17 * m + list(_fp8_gemv_configs()).index(road) + (block[1] if block else 0)
    x, w8, scale, bias = operands(m, dtype, block, seed=seed, with_bias=with_bias)
    got = fp8_gemv(x, w8, scale, block, bias, config=_fp8_gemv_configs()[road])
    assert got.dtype == dtype and got.shape == (m, N)
    want = fp8_gemv_ref(x.float(), w8, scale, block, None if bias is None else bias.float())   # unrounded
    # float32: summation order only; bf16: one rounding of the output (the interpreter truncates: < 1 ulp)
    rel = 0.0 if dtype == torch.float32 else 2 ** -7
    assert ((got.float() - want).abs() <= rel * want.abs() + 1e-4).all()


@interpreted_only
@pytest.mark.parametrize("block", [None, (128, 128)], ids=str)
@pytest.mark.parametrize("m", [1, 16])
def test_fp8_gemv_table_config_runs_a_long_k(block, m):
    """The GPU table's own config (512-byte steps, split-K) at a K of several steps: K=1100 -> 3 steps, 1 split
    at N=40 (a few programs: the table splits K while each split keeps 2 steps)."""
    from kestrel.kernels.triton.fp8_gemv import fp8_gemv, fp8_gemv_ref, split_plan, table_config

    g = torch.Generator().manual_seed(7 + m)
    n, k = 40, 1100
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) * 0.05
    w8, scale = quantize_per_row(w) if block is None else quantize_per_block(w, block)
    cfg = table_config(m, n, k)
    assert cfg.block_k == 512 and split_plan(k, cfg) == (1536, 1)
    got = fp8_gemv(x, w8, scale, block, config=cfg)
    assert_close_scaled(got, fp8_gemv_ref(x, w8, scale, block), 1e-4, "one K range")
    split = replace(cfg, split_k=2)   # and split: 2 ranges of 1024 and 76
    assert split_plan(k, split) == (1024, 2)
    got = fp8_gemv(x, w8, scale, block, config=split)
    assert_close_scaled(got, fp8_gemv_ref(x, w8, scale, block), 1e-4, "split K")


def test_fp8_gemv_table_on_the_8b_layers():
    """The GPU table (no interpreter needed: plain arithmetic): split-K where N / 16 programs are few."""
    from kestrel.kernels.triton.fp8_gemv import split_plan, table_config

    plans = {name: split_plan(k, table_config(1, n, k)) for name, (k, n) in
             {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}.items()}
    assert plans == {"qkv": (2048, 2), "o": (1024, 4), "gate_up": (4096, 1), "down": (3584, 4)}
    assert table_config(16, 4096, 14336).use_dot and not table_config(4, 4096, 14336).use_dot


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


# -- kernels/triton/gemv.py with FP8 weights (row scales), and the method's routing ---------------------------------

def _gemv_configs():
    from kestrel.kernels.triton import gemv

    return {"broadcast": gemv.GemvConfig(block_n=16, block_k=64, use_dot=False),
            "dot-fold4": gemv.GemvConfig(block_n=4, block_k=64, use_dot=True),
            "broadcast-whole-k": gemv.GemvConfig(block_n=4, block_k=256, use_dot=False, num_warps=8)}


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    # bf16: the reference rounds the weight to bf16 first, the kernel does not; two output ulps apart at most
    assert got.dtype == want.dtype
    if got.dtype == torch.float32:
        assert_close_scaled(got, want, 1e-4)
    else:
        assert (got.double() - want.double()).abs().max().item() < 2 ** -6 * want.abs().max().item()


@interpreted_only
@pytest.mark.parametrize("path", ["broadcast", "dot-fold4", "broadcast-whole-k"])
@pytest.mark.parametrize("dtype,m", [(torch.float32, 1), (torch.float32, 5), (torch.bfloat16, 3)])
def test_skinny_kernels_take_fp8_weights_with_row_scales(path, dtype, m):
    from kestrel.kernels.triton import gemv

    config = _gemv_configs()[path]
    x, w8, scale, bias = operands(m, dtype, None, seed=40 + m, with_bias=True)
    w = dequantize(w8, scale).to(dtype)   # exact in float32; the bf16 case rounds the weight once
    _close(gemv.gemv(x, w8, bias, config, w_scale=scale), gemv.gemv_ref(x, w, bias))
    g = torch.Generator().manual_seed(m)
    residual = torch.randn(m, K, generator=g).to(dtype)
    norm_w = (1 + 0.1 * torch.randn(K, generator=g)).to(dtype)
    out, res = gemv.add_rms_norm_gemv(x, residual, norm_w, 1e-5, w8, bias, config, w_scale=scale)
    want, want_res = gemv.add_rms_norm_gemv_ref(x, residual, norm_w, 1e-5, w, bias)
    _close(out, want)
    _close(res, want_res)   # the interpreter's bf16 add may differ from torch's by an ulp
    gate_up = torch.randn(m, 2 * K, generator=g).to(dtype)
    _close(gemv.silu_mul_gemv(gate_up, w8, bias, config, w_scale=scale), gemv.silu_mul_gemv_ref(gate_up, w, bias))


def test_skinny_table_gives_fp8_weights_the_bf16_step_bytes():
    """gemv.py's table for 1-byte weights: twice the K elements a step (the bf16 step's bytes) on 8 warps; the bf16
    choices are the tuned ones (the docstring's examples)."""
    from kestrel.kernels.triton.gemv import GemvConfig, table_config

    assert table_config(1, 4096, 14336) == GemvConfig(16, 512, False, num_warps=4, num_stages=3, unroll=False)
    # FP8 loops stay rolled (software-pipelined): unrolled they cost minutes of compiling on a fresh machine
    rolled = dict(num_stages=3, unroll=False)
    assert table_config(1, 4096, 14336, element_size=1) == GemvConfig(16, 1024, False, num_warps=8, **rolled)
    assert table_config(1, 28672, 4096) == GemvConfig(32, 256, False)
    assert table_config(1, 28672, 4096, element_size=1) == GemvConfig(32, 512, False, num_warps=8, **rolled)
    # tensor cores: the bf16 step (the x operand's registers bound it)
    assert table_config(16, 6144, 4096) == GemvConfig(16, 512, True)
    assert table_config(16, 6144, 4096, element_size=1) == GemvConfig(16, 512, True, **rolled)
    # whole slices are bounded by registers (elements), not bytes: the same for both
    assert table_config(1, 1024, 3072, True, 1) == table_config(1, 1024, 3072, True) == GemvConfig(4, 4096, False,
                                                                                                    num_warps=8)


@interpreted_only
@pytest.mark.parametrize("m", [1, 3, 16])
def test_skinny_fp8_table_config_matches_reference(m):
    """gemv.py's FP8 table config itself (2 x the bf16 K step) at a K of several of its steps, with the norm fold."""
    from kestrel.kernels.triton import gemv

    g = torch.Generator().manual_seed(60 + m)
    n, k = 40, 5000
    x = torch.randn(m, k, generator=g)
    w8, scale = quantize_per_row(torch.randn(n, k, generator=g) * 0.05)
    cfg = gemv.table_config(m, n, k, element_size=1)
    assert cfg.block_k == (1 if cfg.use_dot else 2) * gemv.table_config(m, n, k).block_k
    w = dequantize(w8, scale)
    _close(gemv.gemv(x, w8, None, cfg, w_scale=scale), gemv.gemv_ref(x, w))
    residual = torch.randn(m, k, generator=g)
    norm_w = 1 + 0.1 * torch.randn(k, generator=g)
    out, _ = gemv.add_rms_norm_gemv(x, residual, norm_w, 1e-5, w8, None, cfg, w_scale=scale)
    _close(out, gemv.add_rms_norm_gemv_ref(x, residual, norm_w, 1e-5, w)[0])


@interpreted_only
@pytest.mark.parametrize("block", [None, (32, 32)], ids=["row", "block"])
def test_fp8_method_runs_decode_rows_through_the_kernels(block):
    """A decode-sized batch through an FP8 layer with the kernels (the CUDA choice) gives the reference's output,
    the norm folded in for row and tile scales alike; a larger batch takes the reference."""
    from kestrel.kernels.triton import gemv
    from kestrel.kernels.triton.fp8_gemv import fp8_gemv
    from kestrel.kernels.triton.fp8_gemv import fp8_add_rms_norm_gemv, fp8_silu_mul_gemv
    from kestrel.layers.fp8 import Fp8LinearMethod, Fp8Scheme, SkinnyFp8, SmallFp8Folds
    from kestrel.layers.linear import MergedColumnParallelLinear
    from kestrel.layers.norm import RMSNorm

    scheme = Fp8Scheme(method="test", block=block)
    calls = []

    def counted(fn):
        return lambda *a, **k: calls.append(fn.__name__) or fn(*a, **k)

    fast = Fp8LinearMethod(scheme, small=counted(fp8_gemv), skinny=SkinnyFp8(
        counted(gemv.gemv), counted(gemv.add_rms_norm_gemv), counted(gemv.silu_mul_gemv)),
        small_folds=SmallFp8Folds(counted(fp8_add_rms_norm_gemv), counted(fp8_silu_mul_gemv)))
    ref = Fp8LinearMethod(scheme)
    layers = [MergedColumnParallelLinear(64, [64, 64], method=method) for method in (fast, ref)]
    g = torch.Generator().manual_seed(3)
    for shard in (0, 1):
        w8, scale = (quantize_per_row if block is None else lambda w: quantize_per_block(w, block))(
            torch.randn(64, 64, generator=g) * 0.05)
        for layer in layers:
            layer.weight.weight_loader(layer.weight, w8, "w", shard_id=shard)
            layer.weight_scale.weight_loader(layer.weight_scale, scale, "s", shard_id=shard)
    norm = RMSNorm(64, 1e-5)
    for rows in (2, 20):
        x, residual = torch.randn(rows, 64, generator=g), torch.randn(rows, 64, generator=g)
        got, got_res = layers[0].norm_forward(x, residual, norm)
        want, want_res = layers[1].norm_forward(x, residual, norm)
        assert_close_scaled(got, want, 1e-4)
        assert torch.equal(got_res, want_res)
    assert calls == (["add_rms_norm_gemv"] if block is None else ["fp8_add_rms_norm_gemv"])


# -- fp8_gemv.py builds for sm_90 (Triton's ptxas, no GPU): a compile error costs no device time ----------------

@pytest.mark.skipif(INTERPRETED, reason="compiles; nothing to interpret")
@pytest.mark.parametrize("layer,m,block,prologue", [
    ("qkv", 1, (128, 128), 0), ("down", 1, None, 0), ("down", 16, (128, 128), 0), ("gate_up", 4, None, 0),
    ("qkv", 1, (128, 128), 1), ("gate_up", 16, (128, 128), 1), ("down", 1, (128, 128), 2),
    ("down", 8, (128, 128), 2)], ids=str)
def test_fp8_gemv_table_configs_build_for_sm90(layer, m, block, prologue):
    """The table's config for an 8B layer compiles, plain and with its fold (1: add + RMSNorm before qkv and
    gate_up, 2: SiLU-mul before down); the first step's weights (16-byte loads) come before the PDL wait, and the
    split-K launch's sum kernel builds too."""
    import triton

    from kestrel.kernels.triton.fp8_gemv import (_fp8_gemv_kernel, _seg, _split_sum_kernel, split_plan,
                                                 table_config)
    from tests.sm90 import compile_for_sm90

    k, n = {"qkv": (4096, 6144), "down": (14336, 4096), "gate_up": (4096, 28672)}[layer]
    cfg = table_config(m, n, k)
    k_split, splits = split_plan(k, cfg)
    constexprs = dict(K=k, K_SPLIT=k_split, PROLOGUE=prologue, HAS_RES=prologue == 1, TILE_SCALES=block is not None, SCALE_BN=block[0] if block else 1,
                      SCALE_BK=block[1] if block else 1, HAS_BIAS=True, BLOCK_M=16 if cfg.use_dot else
                      triton.next_power_of_2(m), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SEG=_seg(cfg, block),
                      USE_DOT=cfg.use_dot, UNROLL=cfg.unroll, PARTIAL=splits > 1, DOT_FP32=False,
                      DOT_PRECISION="tf32", USE_PDL=True)
    types = {"w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "out_ptr": "*fp32" if splits > 1 else "*bf16", "eps": "fp32"}
    ptx = compile_for_sm90(_fp8_gemv_kernel, constexprs, types, dict(num_warps=cfg.num_warps,
                                                                     num_stages=cfg.num_stages))
    assert "ld.global" in ptx[:ptx.index("griddepcontrol.wait")]
    assert ("mma" in ptx) == cfg.use_dot
    if splits > 1:
        compile_for_sm90(_split_sum_kernel, dict(SPLITS=splits, HAS_BIAS=True, BLOCK=1024, USE_PDL=True),
                         {"ws_ptr": "*fp32"}, dict(num_warps=4))


@interpreted_only
@pytest.mark.parametrize("block", [None, (16, 32), (128, 128)], ids=str)
@pytest.mark.parametrize("dtype,m,with_res", [(torch.float32, 1, True), (torch.float32, 5, False),
                                              (torch.bfloat16, 3, True), (torch.bfloat16, 16, True)])
def test_fp8_add_rms_norm_gemv_folds_the_norm(block, dtype, m, with_res):
    """add + RMSNorm folded into the FP8 matmul (one launch, the split sum aside): the matmul of the normed rows,
    and x + residual written once, as the unfused norm and fp8_gemv give."""
    from kestrel.kernels.triton.fp8_gemv import fp8_add_rms_norm_gemv, fp8_add_rms_norm_gemv_ref

    x, w8, scale, bias = operands(m, dtype, block, seed=7 + m, with_bias=True)
    g = torch.Generator().manual_seed(m)
    residual = torch.randn(m, K, generator=g).to(dtype) if with_res else None
    norm_w = (1 + 0.1 * torch.randn(K, generator=g)).to(dtype)
    out, res_out = fp8_add_rms_norm_gemv(x, residual, norm_w, 1e-6, w8, scale, block, bias)
    want, want_res = fp8_add_rms_norm_gemv_ref(x, residual, norm_w, 1e-6, w8, scale, block, bias)
    # the residual sum is rounded once to x's dtype (the interpreter truncates: within one ulp of torch's)
    assert ((res_out.double() - want_res.double()).abs() <= want_res.double().abs() * 2 ** -7).all()
    assert_close_to_reference(out, want, dtype)


def assert_close_to_reference(out: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """float32: summation order only; bf16: the reference rounds W to bf16 and the kernel does not, and both round
    the output once (the interpreter truncates): two ulps of the output's magnitude."""
    err, unit = (out.double() - want.double()).abs(), max(1.0, want.double().abs().max().item())
    assert (err <= (1e-4 * unit if dtype == torch.float32 else want.double().abs() * 2 ** -6 + 2e-2 * unit)).all(), \
        err.max()


@interpreted_only
@pytest.mark.parametrize("block", [None, (16, 32), (128, 128)], ids=str)
@pytest.mark.parametrize("dtype,m", [(torch.float32, 2), (torch.bfloat16, 4), (torch.bfloat16, 9)])
def test_fp8_silu_mul_gemv_folds_the_activation(block, dtype, m):
    from kestrel.kernels.triton.fp8_gemv import fp8_silu_mul_gemv, fp8_silu_mul_gemv_ref

    g = torch.Generator().manual_seed(m)
    gate_up = torch.randn(m, 2 * K, generator=g).to(dtype)
    _, w8, scale, bias = operands(m, dtype, block, seed=m, with_bias=True)
    out = fp8_silu_mul_gemv(gate_up, w8, scale, block, bias)
    assert_close_to_reference(out, fp8_silu_mul_gemv_ref(gate_up, w8, scale, block, bias), dtype)
