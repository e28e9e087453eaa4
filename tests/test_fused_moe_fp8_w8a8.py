"""W8A8 FP8 experts (issue 51): the fused MoE kernels with `quantize_x` (activations quantized to E4M3 per token and
per bk-column group in the K loop, FP8 x FP8 dots, activation scale x weight tile scale per step) against
(a) the W8A8 torch reference (layers/moe_fp8.py: fp8_w8a8_experts_reference) and (b) the float oracle (the
dequantized experts with float activations, fp8_experts_reference) at M = 1, 16, 128, 256 tokens, both kernel
paths, under Triton's interpreter in a child pytest; the reference against the dense W8A8 oracle and the switch,
on the CPU.

Bounds, relative to the reference's largest magnitude:
  (a) tight. The kernel quantizes the same groups with the same float32 operations (amax / 448, divide, clamp,
      round to nearest even) and multiplies exact E4M3 values, so the differences are float32 summation order:
      float32 1e-5; bf16 1e-2, about two bf16 steps at the top magnitude (a reordered sum may flip one rounding of
      an expert's output to bf16, and that may move one E4M3 rounding of the quantized intermediate).
  (b) loose, 0.1. Quantizing an activation moves it by at most 2^-4 of itself (3 mantissa bits, nearest), in
      both matmuls in series; the largest seen over these shapes and seeds is 5.6e-2.
"""
from __future__ import annotations

import pytest
import torch

from kestrel.kernels.fp8_quant import fp8_w8a8_ref
from kestrel.layers.linear import silu_and_mul_torch
from kestrel.layers.moe_fp8 import fp8_experts_reference, fp8_w8a8_experts_reference
from tests.test_fused_moe_fp8 import fp8_problem
from tests.tolerances import assert_close_relative
from tests.triton_interpreter import INTERPRETED, run_file_under_interpreter
from tests.triton_interpreter import interpreted_only as interpreted_only_marker

interpreted_only = interpreted_only_marker("test_fused_moe_w8a8_under_triton_interpreter")

TIGHT = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
LOOSE = 0.1


@pytest.mark.slow   # a child pytest running the file's kernels in Triton's interpreter
@pytest.mark.skipif(INTERPRETED, reason="this is the interpreter child")
def test_fused_moe_w8a8_under_triton_interpreter():
    run_file_under_interpreter(__file__, min_passed=len(SHAPES) * len(MS) * 2 + 3)


def test_w8a8_reference_is_the_dense_w8a8_oracle_per_expert():
    """One expert, top-1, weight 1: the MoE reference is two fp8_w8a8_ref matmuls around silu-mul, bit for bit."""
    block = (16, 32)
    x, w13, s13, w2, s2, _, _ = fp8_problem(5, 1, 1, 64, 32, block, torch.float32, seed=2)
    ids, weights = torch.zeros(5, 1, dtype=torch.long), torch.ones(5, 1)
    inter = silu_and_mul_torch(fp8_w8a8_ref(x, w13[0], s13[0], block))   # I = 32: per-part tiles = merged tiles
    dense = fp8_w8a8_ref(inter, w2[0], s2[0], block)
    torch.testing.assert_close(fp8_w8a8_experts_reference(x, w13, w2, ids, weights, s13, s2, block), dense,
                               atol=0, rtol=0)


def test_fp8_moe_switch_defaults_to_w8a16_and_refuses_other_values(monkeypatch):
    from kestrel.envs import switches

    monkeypatch.delenv("KESTREL_FP8_MOE", raising=False)
    switches.cache_clear()
    try:
        assert switches().fp8_moe == "w8a16"
        monkeypatch.setenv("KESTREL_FP8_MOE", "w4a8")
        switches.cache_clear()
        with pytest.raises(ValueError, match="KESTREL_FP8_MOE"):
            switches()
    finally:
        switches.cache_clear()


MS = [1, 16, 128, 256]
SHAPES = [  # (experts, topk, hidden, inter, block, dtype)
    (8, 2, 64, 32, (16, 32), torch.float32),      # several scale tiles and activation groups along every dim
    (6, 2, 48, 40, (16, 16), torch.float32),      # I off the group: a short last group of the intermediate
    (8, 2, 64, 32, (128, 128), torch.bfloat16),   # the checkpoints' tile, wider than the shapes: one short group
    (8, 2, 64, 32, (16, 32), torch.bfloat16),
]


def row_config(m: int, inter: int, hidden: int):
    """The interpreter's small row tiles at decode sizes; past them one program a row (gate|up) and a token
    (down), so 128 and 256 tokens run in seconds (the interpreter pays per program)."""
    from kestrel.kernels.triton.fused_moe import RowTiles

    if m <= 16:
        return None
    return RowTiles(up_n=triton_pow2(inter), up_k=16, up_warps=4, down_n=triton_pow2(hidden), down_k=16,
                    down_warps=4)


def triton_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


@interpreted_only
@pytest.mark.parametrize("path", ["tiles", "rows"])
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"E{s[0]}k{s[1]}H{s[2]}I{s[3]}b{s[4][0]}x{s[4][1]}-{s[5]}")
def test_w8a8_fused_moe_equals_the_w8a8_reference_and_nears_the_float_one(shape, m, path):
    from kestrel.kernels.triton.fused_moe import fused_experts_triton

    experts, topk, hidden, inter, block, dtype = shape
    x, w13, s13, w2, s2, ids, weights = fp8_problem(m, experts, topk, hidden, inter, block, dtype, seed=m)
    ours = fused_experts_triton(x, w13, w2, ids, weights, path=path, w13_scale=s13, w2_scale=s2, block=block,
                                quantize_x=True, row_config=row_config(m, inter, hidden) if path == "rows" else None)
    assert ours.dtype == dtype and ours.shape == x.shape
    assert_close_relative(ours, fp8_w8a8_experts_reference(x, w13, w2, ids, weights, s13, s2, block), TIGHT[dtype],
                          "vs the W8A8 reference")
    assert_close_relative(ours, fp8_experts_reference(x, w13, w2, ids, weights, s13, s2, block), LOOSE,
                          "vs the float-activation oracle")


@interpreted_only
def test_w8a8_needs_fp8_experts_and_a_power_of_two_group():
    from kestrel.kernels.triton.fused_moe import fused_experts_triton

    x, w13, s13, w2, s2, ids, weights = fp8_problem(4, 4, 2, 48, 16, (16, 48), torch.float32, seed=1)
    with pytest.raises(AssertionError, match="power-of-two"):
        fused_experts_triton(x, w13, w2, ids, weights, w13_scale=s13, w2_scale=s2, block=(16, 48), quantize_x=True)
    with pytest.raises(AssertionError, match="W8A8"):
        fused_experts_triton(x, w13.float(), w2.float(), ids, weights, quantize_x=True)
