"""FP8 experts (layers/moe_fp8.py): the fused MoE kernel reading block-FP8 weights equals the dequantized torch
reference at M = 1, 16, 128, 256 tokens, both kernel paths, under Triton's interpreter in a child pytest; the
stacked layout's quantize / dequantize round trip and the per-part scale layout, on the CPU.

Bounds: the kernel widens each FP8 tile with its scale to x's dtype exactly as the reference's dequantize does, so
it multiplies the same weights; what is left is summation order: float32 1e-5 (as the float kernel's tests), bf16
3e-2 relative (one bf16 rounding of a sum of a few terms, as the float kernel's bf16 bound)."""
from __future__ import annotations

import pytest
import torch

from kestrel.kernels.fp8_quant import FP8, dequantize, quantize_per_block
from kestrel.layers.moe_fp8 import dequantize_stacked, fp8_experts_reference, quantize_stacked
from tests.tolerances import scaled
from tests.triton_interpreter import INTERPRETED, run_file_under_interpreter
from tests.triton_interpreter import interpreted_only as interpreted_only_marker

interpreted_only = interpreted_only_marker("test_fused_moe_fp8_under_triton_interpreter")


@pytest.mark.slow   # a child pytest running the file's kernels in Triton's interpreter
@pytest.mark.skipif(INTERPRETED, reason="this is the interpreter child")
def test_fused_moe_fp8_under_triton_interpreter():
    run_file_under_interpreter(__file__, min_passed=32)   # all but the launcher and the rows path past 16 tokens


def fp8_problem(tokens: int, experts: int, topk: int, hidden: int, inter: int, block: tuple[int, int],
                dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    # rows of very different magnitudes, so tiles get different scales and a misplaced one shows
    w13 = 0.2 * torch.randn(experts, 2 * inter, hidden, generator=gen) * torch.rand(experts, 2 * inter, 1,
                                                                                   generator=gen) * 4
    w2 = 0.2 * torch.randn(experts, hidden, inter, generator=gen) * torch.rand(experts, 1, inter, generator=gen) * 4
    w13[:, inter:] *= 3   # up's tiles scaled unlike gate's: swapping the two parts' scales is an error that shows
    w13_8, s13 = quantize_stacked(w13, block, parts=2)
    w2_8, s2 = quantize_stacked(w2, block, parts=1)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(tokens)])
    weights = torch.rand(tokens, topk, generator=gen)
    return x, w13_8, s13, w2_8, s2, ids, weights


def test_stacked_quantization_is_per_part_and_round_trips():
    """Gate and up are quantized as the checkpoint's separate tensors (their tiles never shared, even where I is
    not a multiple of the tile), and dequantizing gives each part's own dequantize()."""
    block = (16, 32)
    w = torch.randn(3, 2 * 24, 40)
    w8, scale = quantize_stacked(w, block, parts=2)
    assert w8.dtype == FP8 and scale.shape == (3, 2 * 2, 2)
    back = dequantize_stacked(w8, scale, block, parts=2)
    for e in range(3):
        for p in range(2):
            part = w[e, p * 24:(p + 1) * 24]
            q8, qs = quantize_per_block(part, block)
            torch.testing.assert_close(back[e, p * 24:(p + 1) * 24], dequantize(q8, qs, block), atol=0, rtol=0)
    assert (back - w).abs().max() <= w.abs().max() / 8   # E4M3: 3 mantissa bits


MS = [1, 16, 128, 256]
SHAPES = [  # (experts, topk, hidden, inter, block, dtype)
    (8, 2, 64, 32, (16, 32), torch.float32),      # several scale tiles along every dim
    (6, 2, 48, 40, (16, 16), torch.float32),      # I off the tile: per-part tiles, short last tiles
    (4, 2, 32, 16, (2, 16), torch.float32),       # row tiles narrower than the rows path's column blocks
    (8, 2, 64, 32, (128, 128), torch.bfloat16),   # the checkpoints' tile, bigger than the shapes
    (8, 2, 64, 32, (16, 32), torch.bfloat16),
]


@interpreted_only
@pytest.mark.parametrize("path", ["tiles", "rows"])
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"E{s[0]}k{s[1]}H{s[2]}I{s[3]}b{s[4][0]}x{s[4][1]}-{s[5]}")
def test_fp8_fused_moe_equals_dequantized_reference(shape, m, path):
    from kestrel.kernels.triton.fused_moe import fused_experts_triton

    experts, topk, hidden, inter, block, dtype = shape
    if path == "rows" and m > 16:
        pytest.skip("the rows path serves decode-sized batches")
    x, w13, s13, w2, s2, ids, weights = fp8_problem(m, experts, topk, hidden, inter, block, dtype, seed=m)
    ours = fused_experts_triton(x, w13, w2, ids, weights, path=path, w13_scale=s13, w2_scale=s2, block=block)
    ref = fp8_experts_reference(x, w13, w2, ids, weights, s13, s2, block)
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(ours, ref, **scaled(tol, ref))


@interpreted_only
def test_float_experts_unchanged_by_the_fp8_arguments():
    """Float experts take no scales; passing FP8 weights without them is refused rather than read as float."""
    from kestrel.kernels.triton.fused_moe import fused_experts_triton

    x, w13, s13, w2, s2, ids, weights = fp8_problem(4, 4, 2, 32, 16, (16, 16), torch.float32, seed=1)
    with pytest.raises(AssertionError):
        fused_experts_triton(x, w13, w2, ids, weights)
