"""Compiled skinny-matmul kernels agree with their torch references on CUDA at real layer shapes (Qwen3-0.6B,
Llama-3.1-8B), with the default configs, eagerly and under CUDA-graph capture and replay.

Same contract as tests/test_gemv.py (the kernels in Triton's CPU interpreter). Compiled casts round like torch, so
here the residual stream is bit-equal and most 16-bit outputs are too: the kernel only sums in another order than
cuBLAS (and its rsqrt is the fast one), which moves an output by an ulp where it sits near a rounding boundary.
"""
from __future__ import annotations

import pytest
import torch

from kestrel.kernels.triton import gemv
from tests.test_gemv import assert_matches, inputs

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

LAYERS = {  # name: (K, N)
    "0.6b.qkv": (1024, 4096), "0.6b.o": (2048, 1024), "0.6b.gate_up": (1024, 6144), "0.6b.down": (3072, 1024),
    "8b.qkv": (4096, 6144), "8b.o": (4096, 4096), "8b.gate_up": (4096, 28672), "8b.down": (14336, 4096),
}
BATCHES = [1, 4, 16]   # one row; the broadcast path's widest (BROADCAST_MAX_M); the tensor-core path's widest


def cuda_inputs(m: int, k: int, n: int, dtype: torch.dtype, seed: int, with_bias: bool = False) -> dict:
    t = inputs(m, dtype, seed, with_bias=with_bias, k=k, n=n, row_pad=16)   # x, residual: row slices
    return {name: None if v is None else v.cuda() for name, v in t.items()}


def mostly_bit_equal(got: torch.Tensor, want: torch.Tensor, share: float = 0.9) -> None:
    assert_matches(got, want)
    if got.dtype != torch.float32:
        assert (got == want).float().mean().item() >= share


@pytest.mark.parametrize("m", BATCHES)
@pytest.mark.parametrize("layer", list(LAYERS))
def test_gemv_matches_cublas(layer, m):
    k, n = LAYERS[layer]
    t = cuda_inputs(m, k, n, torch.bfloat16, seed=m, with_bias=m == 2)
    mostly_bit_equal(gemv.gemv(t["x"], t["w"], t["bias"]), gemv.gemv_ref(t["x"], t["w"], t["bias"]))


@pytest.mark.parametrize("m", BATCHES)
@pytest.mark.parametrize("layer", ["0.6b.qkv", "0.6b.gate_up", "8b.qkv", "8b.gate_up"])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_gemv_matches_reference(layer, m, with_residual):
    k, n = LAYERS[layer]
    t = cuda_inputs(m, k, n, torch.bfloat16, seed=100 + m, with_bias=m == 4)
    residual = t["residual"] if with_residual else None
    out, res_out = gemv.add_rms_norm_gemv(t["x"], residual, t["norm_weight"], 1e-6, t["w"], t["bias"])
    want, want_res = gemv.add_rms_norm_gemv_ref(t["x"], residual, t["norm_weight"], 1e-6, t["w"], t["bias"])
    mostly_bit_equal(out, want)
    if with_residual:
        assert torch.equal(res_out, want_res)
    else:
        assert res_out is t["x"]


@pytest.mark.parametrize("m", BATCHES)
@pytest.mark.parametrize("layer", ["0.6b.down", "8b.down"])
def test_silu_mul_gemv_matches_reference(layer, m):
    k, n = LAYERS[layer]
    t = cuda_inputs(m, k, n, torch.bfloat16, seed=200 + m, with_bias=m == 8)
    mostly_bit_equal(gemv.silu_mul_gemv(t["gate_up"], t["w"], t["bias"]),
                     gemv.silu_mul_gemv_ref(t["gate_up"], t["w"], t["bias"]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("m", [1, 16])
def test_other_dtypes(dtype, m):
    t = cuda_inputs(m, 2048, 1024, dtype, seed=300 + m, with_bias=True)
    mostly_bit_equal(gemv.gemv(t["x"], t["w"], t["bias"]), gemv.gemv_ref(t["x"], t["w"], t["bias"]), 0.8)
    out, res_out = gemv.add_rms_norm_gemv(t["x"], t["residual"], t["norm_weight"], 1e-6, t["w"])
    want, want_res = gemv.add_rms_norm_gemv_ref(t["x"], t["residual"], t["norm_weight"], 1e-6, t["w"])
    mostly_bit_equal(out, want, 0.8)
    assert torch.equal(res_out, want_res)


@pytest.mark.parametrize("m", [1, 8])
def test_captured_in_a_cuda_graph_replays_new_inputs(m):
    k, n = LAYERS["0.6b.gate_up"]
    t = cuda_inputs(m, k, n, torch.bfloat16, seed=400)
    gate_up = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)         # [gate | up], I = N / 2
    w_down = (torch.randn(k, n // 2, device="cuda") / (n // 2) ** 0.5).to(torch.bfloat16)
    args = (t["x"], t["residual"], t["norm_weight"], 1e-6, t["w"])
    gemv.add_rms_norm_gemv(*args)                                            # compile outside the capture
    gemv.silu_mul_gemv(gate_up, w_down)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, res_out = gemv.add_rms_norm_gemv(*args)
        down = gemv.silu_mul_gemv(gate_up, w_down)
    for seed in (1, 2):
        new = cuda_inputs(m, k, n, torch.bfloat16, seed=400 + seed)
        t["x"].copy_(new["x"])
        t["residual"].copy_(new["residual"])
        gate_up.normal_()
        graph.replay()
        want, want_res = gemv.add_rms_norm_gemv_ref(*args)
        mostly_bit_equal(out, want)
        assert torch.equal(res_out, want_res)
        mostly_bit_equal(down, gemv.silu_mul_gemv_ref(gate_up, w_down))
