"""FP8 weights on CUDA: the compiled Triton FP8 skinny matmuls (fp8_gemv.py; gemv.py with row scales) and the
torch._scaled_mm path against their torch references at real layer shapes, a CUDA-graph replay of the kernel, the
engine's greedy tokens with and without graphs, and the kernels' times next to bf16's (printed: the GPU figures of
issue #34; benchmarks/fp8_gemv_bench.py times them in CUDA graphs over rotating weights).

Same contract as tests/test_fp8_gemv.py (the kernel in Triton's CPU interpreter). Written without a GPU at hand:
the first GPU run is its first run."""
from __future__ import annotations

import pytest
import torch

from kestrel.kernels.fp8_quant import quantize_per_block, quantize_per_row
from tests.gpu.engine_tokens import greedy_tokens
from tests.gpu.timing import time_us

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

LAYERS = {  # name: (K, N)
    "0.6b.qkv": (1024, 4096), "0.6b.down": (3072, 1024), "8b.qkv": (4096, 6144), "8b.gate_up": (4096, 28672),
    "8b.down": (14336, 4096),
}
BLOCKS = {"row": None, "block128": (128, 128)}


def operands(k: int, n: int, m: int, block, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.randn(n, k, device="cuda", generator=g) * 0.02
    w8, scale = quantize_per_row(w) if block is None else quantize_per_block(w, block)
    return x, w8, scale.contiguous()


@pytest.mark.parametrize("m", [1, 4, 16])
@pytest.mark.parametrize("scales", list(BLOCKS))
@pytest.mark.parametrize("layer", list(LAYERS))
def test_fp8_gemv_matches_reference(layer, scales, m):
    from kestrel.kernels.triton.fp8_gemv import fp8_gemv, fp8_gemv_ref

    k, n = LAYERS[layer]
    x, w8, scale = operands(k, n, m, BLOCKS[scales])
    got = fp8_gemv(x, w8, scale, BLOCKS[scales])
    want = fp8_gemv_ref(x, w8, scale, BLOCKS[scales])
    # both sum float32 products of the same values; bf16 outputs differ by the summation order's last ulp
    assert torch.allclose(got.float(), want.float(), rtol=1.6e-2, atol=1e-2)


@pytest.mark.parametrize("m", [1, 4, 16])
@pytest.mark.parametrize("layer", list(LAYERS))
def test_skinny_kernels_with_fp8_row_scales_match_reference(layer, m):
    """kernels/triton/gemv.py with w_scale (the road of row-scaled FP8 layers), default configs."""
    from kestrel.kernels.triton import gemv
    from kestrel.kernels.triton.fp8_gemv import fp8_gemv_ref

    k, n = LAYERS[layer]
    x, w8, scale = operands(k, n, m, None)
    got = gemv.gemv(x, w8, w_scale=scale)
    assert torch.allclose(got.float(), fp8_gemv_ref(x, w8, scale).float(), rtol=1.6e-2, atol=1e-2)


SPLIT_CONFIGS = {  # fp8_gemv.py roads beside the table's (benchmarks/fp8_gemv_bench.py sweeps these)
    "broadcast-split8": dict(block_n=16, block_k=512, split_k=8, unroll=True),
    "broadcast-1024-pipelined": dict(block_n=16, block_k=1024, split_k=2, num_warps=8),
    "broadcast-256-nosplit": dict(block_n=16, block_k=256, split_k=1),
    "dot-split4": dict(block_n=16, block_k=512, split_k=4, use_dot=True, unroll=True),
    "dot-32rows-pipelined": dict(block_n=32, block_k=256, split_k=2, use_dot=True, num_warps=8),
}


@pytest.mark.parametrize("m", [1, 16])
@pytest.mark.parametrize("scales", list(BLOCKS))
@pytest.mark.parametrize("road", list(SPLIT_CONFIGS))
@pytest.mark.parametrize("layer", ["8b.qkv", "8b.down"])
def test_fp8_gemv_configs_match_reference(layer, road, scales, m):
    """Split-K on and off, both loop forms, broadcast and tensor cores, compiled, at the 8B's small-N shapes."""
    from kestrel.kernels.triton.fp8_gemv import Fp8GemvConfig, fp8_gemv, fp8_gemv_ref

    k, n = LAYERS[layer]
    x, w8, scale = operands(k, n, m, BLOCKS[scales], seed=m)
    bias = torch.randn(n, device="cuda").to(torch.bfloat16)
    got = fp8_gemv(x, w8, scale, BLOCKS[scales], bias, config=Fp8GemvConfig(**SPLIT_CONFIGS[road]))
    want = fp8_gemv_ref(x, w8, scale, BLOCKS[scales], bias)
    assert torch.allclose(got.float(), want.float(), rtol=1.6e-2, atol=1e-2)


@pytest.mark.parametrize("scales", list(BLOCKS))
def test_fp8_gemv_replays_in_a_cuda_graph(scales):
    """The default config at qkv's shape splits K: two kernels (PDL-linked on Hopper) and a workspace, captured."""
    from kestrel.kernels.triton.fp8_gemv import default_config, fp8_gemv, split_plan

    x, w8, scale = operands(4096, 6144, 2, BLOCKS[scales])
    assert split_plan(4096, default_config(2, 6144, 4096))[1] > 1
    eager = fp8_gemv(x, w8, scale, BLOCKS[scales])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_gemv(x, w8, scale, BLOCKS[scales])
    x.copy_(x * 0.5)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.allclose(out.float(), (eager.float() * 0.5), rtol=2e-2, atol=1e-2)


@pytest.mark.parametrize("layer", ["0.6b.qkv", "8b.gate_up"])
def test_scaled_mm_path_is_within_activation_quantization_error(layer):
    from kestrel.kernels.triton.fp8_gemv import fp8_gemv_ref
    from kestrel.layers.fp8 import scaled_mm_linear

    k, n = LAYERS[layer]
    x, w8, scale = operands(k, n, 256, None)
    got = scaled_mm_linear(x, w8, scale, None).float()
    want = fp8_gemv_ref(x.float(), w8, scale).float()
    assert ((got - want).abs().max() / want.abs().max()).item() < 0.03


def test_fp8_engine_graphs_keep_eager_tokens(monkeypatch):
    """float32 activations: the decode graphs and eager decode run the same FP8 kernel on the same inputs."""
    graphs = greedy_tokens(None, monkeypatch, {}, quantization="fp8", dtype="float32")
    eager = greedy_tokens(None, monkeypatch, {}, quantization="fp8", dtype="float32", disable_cuda_graph=True)
    assert graphs == eager


def _time_us(fn, iters: int = 200) -> float:
    return time_us(fn, iters, warmup=10)


def test_fp8_gemv_time_next_to_bf16(capsys):
    from kestrel.kernels.triton import gemv
    from kestrel.kernels.triton.fp8_gemv import fp8_gemv

    rows = []
    for layer in ("8b.qkv", "8b.gate_up", "8b.down"):
        k, n = LAYERS[layer]
        x, w8, scale = operands(k, n, 1, None)
        w16 = (w8.float() * scale).to(torch.bfloat16)
        _, w8b, block_scale = operands(k, n, 1, (128, 128))
        fp8_us = _time_us(lambda: fp8_gemv(x, w8, scale))
        fp8_block_us = _time_us(lambda: fp8_gemv(x, w8b, block_scale, (128, 128)))
        fp8_skinny_us = _time_us(lambda: gemv.gemv(x, w8, w_scale=scale))
        bf16_us = _time_us(lambda: gemv.gemv(x, w16))
        cublas_us = _time_us(lambda: torch.nn.functional.linear(x, w16))
        rows.append(f"{layer} bs1: fp8 fp8_gemv.py row {fp8_us:.1f} us, block128 {fp8_block_us:.1f} us "
                    f"({n * k / fp8_block_us / 1e3:.0f} GB/s), fp8 gemv.py {fp8_skinny_us:.1f} us "
                    f"({n * k / fp8_skinny_us / 1e3:.0f} GB/s), bf16 gemv.py {bf16_us:.1f} us, "
                    f"bf16 cuBLAS {cublas_us:.1f} us")
    with capsys.disabled():
        print("\n" + "\n".join(rows))
    assert all("fp8" in r for r in rows)


@pytest.mark.parametrize("m", [17, 128, 512])
@pytest.mark.parametrize("layer", ["8b.qkv", "8b.down"])
def test_fp8_block_gemm_matches_reference(layer, m):
    """M > 16 rows with 128 x 128 tile scales (decode at high concurrency, prefill chunks): the W8A16 block GEMM;
    at 128 rows the down projection splits K."""
    from kestrel.kernels.triton.fp8_block_gemm import fp8_block_gemm
    from kestrel.kernels.triton.fp8_gemv import fp8_gemv_ref

    k, n = LAYERS[layer]
    x, w8, scale = operands(k, n, m, (128, 128))
    got = fp8_block_gemm(x, w8, scale, (128, 128))
    assert torch.allclose(got.float(), fp8_gemv_ref(x, w8, scale, (128, 128)).float(), rtol=1.6e-2, atol=1e-2)


@pytest.mark.parametrize("m", [17, 128, 256, 2048])
@pytest.mark.parametrize("layer", ["8b.qkv", "8b.down"])
def test_w8a8_block_gemm_matches_its_reference(layer, m):
    """W8A8 (x quantized per 1 x 128 group in the kernel, FP8 wgmma): against fp8_w8a8_ref, the same quantization
    in torch, to bf16's output rounding plus the rare activation that the GPU's approximate division rounds to the
    neighbouring E4M3 value; against the bf16-activation product within FP8's activation error."""
    from kestrel.kernels.fp8_quant import fp8_w8a8_ref
    from kestrel.kernels.triton.fp8_block_gemm import fp8_block_gemm
    from kestrel.kernels.triton.fp8_gemv import fp8_gemv_ref

    k, n = LAYERS[layer]
    x, w8, scale = operands(k, n, m, (128, 128))
    got = fp8_block_gemm(x, w8, scale, (128, 128), quantize_x=True).float()
    want = fp8_w8a8_ref(x, w8, scale, (128, 128)).float()
    assert (got - want).norm() / want.norm() < 4e-3
    exact = fp8_gemv_ref(x, w8, scale, (128, 128)).float()
    assert (got - exact).norm() / exact.norm() < 5e-2


def test_fp8_block_gemm_replays_in_a_cuda_graph_and_beats_dequantizing(capsys):
    from kestrel.kernels.triton.fp8_block_gemm import fp8_block_gemm
    from kestrel.kernels.fp8_quant import dequantize

    k, n = LAYERS["8b.down"]
    x, w8, scale = operands(k, n, 128, (128, 128))
    eager = fp8_block_gemm(x, w8, scale, (128, 128))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_block_gemm(x, w8, scale, (128, 128))
    x.copy_(x * 0.5)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.allclose(out.float(), eager.float() * 0.5, rtol=2e-2, atol=1e-2)
    w16 = dequantize(w8, scale, (128, 128)).to(torch.bfloat16)
    gemm_us = _time_us(lambda: fp8_block_gemm(x, w8, scale, (128, 128)))
    dequant_us = _time_us(lambda: torch.nn.functional.linear(x, dequantize(w8, scale, (128, 128)).to(x.dtype)))
    cublas_us = _time_us(lambda: torch.nn.functional.linear(x, w16))
    with capsys.disabled():
        print(f"\n8b.down M=128 block128: fp8_block_gemm {gemm_us:.1f} us ({n * k / gemm_us / 1e3:.0f} GB/s), "
              f"dequantize + linear {dequant_us:.1f} us, bf16 cuBLAS {cublas_us:.1f} us")
    assert gemm_us < dequant_us


@pytest.mark.parametrize("m", [1, 4, 16])
def test_fp8_gemv_folds_match_reference(m):
    """Tile scales with the add + RMSNorm (before qkv) and the SiLU-mul (before down) folded into fp8_gemv."""
    from kestrel.kernels.triton.fp8_gemv import (fp8_add_rms_norm_gemv, fp8_add_rms_norm_gemv_ref,
                                                 fp8_silu_mul_gemv, fp8_silu_mul_gemv_ref)

    k, n = LAYERS["8b.qkv"]
    x, w8, scale = operands(k, n, m, (128, 128), seed=1)
    residual = torch.randn_like(x)
    norm_w = (1 + 0.1 * torch.randn(k, device="cuda")).to(torch.bfloat16)
    out, res = fp8_add_rms_norm_gemv(x, residual, norm_w, 1e-5, w8, scale, (128, 128))
    want, want_res = fp8_add_rms_norm_gemv_ref(x, residual, norm_w, 1e-5, w8, scale, (128, 128))
    assert torch.equal(res, want_res)
    assert torch.allclose(out.float(), want.float(), rtol=3e-2, atol=3e-2)
    k, n = LAYERS["8b.down"]
    _, w8, scale = operands(k, n, m, (128, 128), seed=2)
    gate_up = torch.randn(m, 2 * k, device="cuda").to(torch.bfloat16)
    assert torch.allclose(fp8_silu_mul_gemv(gate_up, w8, scale, (128, 128)).float(),
                          fp8_silu_mul_gemv_ref(gate_up, w8, scale, (128, 128)).float(), rtol=3e-2, atol=3e-2)
