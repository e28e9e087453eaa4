"""Block-FP8 experts on CUDA (issue 51): the fused Triton MoE kernel reading FP8 weights with their 128 x 128 tile
scales (W8A16) against the dequantized torch oracle (layers/moe_fp8.py: fp8_experts_reference) at Qwen3-30B-A3B's
layer shape, M = 1, 16, 128, 256 tokens, both paths; no host sync and a CUDA-graph replay; an FP8 MoE checkpoint's
greedy tokens with the fused kernel equal to the dequantizing torch road's; a dummy FP8 MoE shape served with graphs.

Same contract as tests/test_fused_moe_fp8.py (there under Triton's interpreter). Written without a GPU at hand.
Bounds: the kernel widens each FP8 tile to x's dtype with its scale exactly as the oracle's dequantize does, so both
multiply the same bf16 weights; the rest is the float kernel's bf16 bound (tests/gpu/test_moe_gpu.py), and float32
within 1e-5 (summation order only).

W8A8 (quantize_x, KESTREL_FP8_MOE=w8a8; tests/test_fused_moe_fp8_w8a8.py under the interpreter): against the W8A8
reference (fp8_w8a8_experts_reference: the same activation groups quantized in torch) within the same bf16 bound,
and against the float-activation oracle within 0.1 of its largest magnitude (loose: E4M3 moves each activation by
up to 2^-4 of itself, in both matmuls); a CUDA-graph replay; the layer timed beside W8A16 and bf16."""
from __future__ import annotations

import pytest
import torch

from kestrel.layers.moe_fp8 import (dequantize_stacked, fp8_experts_reference, fp8_w8a8_experts_reference,
                                    quantize_stacked)
from tests.gpu.test_moe_gpu import LAYERS, assert_close_bf16, problem
from tests.gpu.timing import time_us
from tests.tolerances import assert_close_relative

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
# FP8 x FP8 tensor-core dots: Ada (sm89) and newer; Kestrel selects W8A8 on Hopper (sm90) and newer
needs_fp8_dot = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                                   reason="W8A8 needs FP8 tensor cores (sm89+)")
W8A8_VS_FLOAT = 0.1

BLOCK = (128, 128)


def fp8_problem(tokens: int, layer: str = "qwen3-30b-a3b", seed: int = 0, dtype: torch.dtype = torch.bfloat16):
    experts, topk, hidden, inter = LAYERS[layer]
    x, w13, w2, ids, weights = problem(tokens, experts, topk, hidden, inter, seed=seed, dtype=torch.float32)
    w13_8, s13 = quantize_stacked(w13, BLOCK, parts=2)
    w2_8, s2 = quantize_stacked(w2, BLOCK, parts=1)
    return x.to(dtype), w13_8, s13, w2_8, s2, ids, weights


def run(x, w13, s13, w2, s2, ids, weights, path=None, quantize_x=False):
    from kestrel.kernels.triton.fused_moe import fused_experts_triton

    return fused_experts_triton(x, w13, w2, ids, weights, path=path, w13_scale=s13, w2_scale=s2, block=BLOCK,
                                quantize_x=quantize_x)


@pytest.mark.parametrize("path", ["rows", "tiles", None])
@pytest.mark.parametrize("tokens", [1, 16, 128, 256])
@pytest.mark.parametrize("layer", list(LAYERS))
def test_fp8_fused_moe_matches_the_dequantized_reference(layer, tokens, path):
    if path == "rows" and tokens > 16:
        pytest.skip("the rows path serves decode-sized batches")
    x, w13, s13, w2, s2, ids, weights = fp8_problem(tokens, layer, seed=tokens)
    assert_close_bf16(run(x, w13, s13, w2, s2, ids, weights, path),
                      fp8_experts_reference(x, w13, w2, ids, weights, s13, s2, BLOCK))


@needs_fp8_dot
@pytest.mark.parametrize("path", ["rows", "tiles", None])
@pytest.mark.parametrize("tokens", [1, 16, 128, 256])
@pytest.mark.parametrize("layer", list(LAYERS))
def test_w8a8_fused_moe_matches_the_w8a8_reference_and_nears_the_float_one(layer, tokens, path):
    x, w13, s13, w2, s2, ids, weights = fp8_problem(tokens, layer, seed=tokens)
    ours = run(x, w13, s13, w2, s2, ids, weights, path, quantize_x=True)
    assert_close_bf16(ours, fp8_w8a8_experts_reference(x, w13, w2, ids, weights, s13, s2, BLOCK))
    assert_close_relative(ours, fp8_experts_reference(x, w13, w2, ids, weights, s13, s2, BLOCK), W8A8_VS_FLOAT,
                          "W8A8 vs the float-activation oracle")


def test_fp8_moe_switch_picks_w8a8_on_hopper(monkeypatch):
    from kestrel.envs import switches
    from kestrel.kernels.triton.fused_moe import fused_experts_triton
    from kestrel.layers.moe_fp8 import with_fp8_experts

    device = torch.device("cuda")
    try:
        for value, want in (("w8a16", False), ("w8a8", torch.cuda.get_device_capability() >= (9, 0))):
            monkeypatch.setenv("KESTREL_FP8_MOE", value)
            switches.cache_clear()
            assert with_fp8_experts(fused_experts_triton, BLOCK, "weight_scale_inv", device).quantize_x == want
    finally:
        switches.cache_clear()


@pytest.mark.parametrize("path", ["rows", "tiles"])
def test_fp8_fused_moe_float32_is_near_exact(path):
    x, w13, s13, w2, s2, ids, weights = fp8_problem(16, seed=3, dtype=torch.float32)
    ref = fp8_experts_reference(x, w13, w2, ids, weights, s13, s2, BLOCK)
    torch.testing.assert_close(run(x, w13, s13, w2, s2, ids, weights, path), ref, rtol=1e-5,
                               atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("quantize_x", [False, pytest.param(True, marks=needs_fp8_dot)], ids=["w8a16", "w8a8"])
@pytest.mark.parametrize("tokens", [1, 8, 128])
def test_fp8_fused_moe_makes_no_host_sync_and_replays_in_a_graph(tokens, quantize_x):
    x, w13, s13, w2, s2, ids, weights = fp8_problem(tokens, seed=5)
    run(x, w13, s13, w2, s2, ids, weights, quantize_x=quantize_x)   # compile first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run(x, w13, s13, w2, s2, ids, weights, quantize_x=quantize_x)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(x, w13, s13, w2, s2, ids, weights, quantize_x=quantize_x)
    x2, *_, ids2, weights2 = fp8_problem(tokens, seed=6)
    x.copy_(x2)
    ids.copy_(ids2)
    weights.copy_(weights2)
    graph.replay()
    torch.cuda.synchronize()
    ref = fp8_w8a8_experts_reference if quantize_x else fp8_experts_reference
    assert_close_bf16(out, ref(x, w13, w2, ids, weights, s13, s2, BLOCK))


@pytest.mark.parametrize("layer", list(LAYERS))
def test_fp8_moe_layer_times_printed(layer, capsys):
    """Informative, and the measurement KESTREL_FP8_MOE's default waits on: one MoE layer, FP8 W8A8 and W8A16
    against bf16 (the same weights dequantized), at 1 to 256 tokens (tuned tiles where moe_configs/ has them)."""
    from kestrel.kernels.triton.fused_moe import fused_experts_triton

    w8a8_ok = torch.cuda.get_device_capability() >= (8, 9)
    for tokens in (1, 16, 64, 128, 256):
        x, w13, s13, w2, s2, ids, weights = fp8_problem(tokens, layer, seed=7)
        w13b = dequantize_stacked(w13, s13, BLOCK, 2).to(torch.bfloat16)
        w2b = dequantize_stacked(w2, s2, BLOCK, 1).to(torch.bfloat16)
        w8a16 = time_us(lambda: run(x, w13, s13, w2, s2, ids, weights))
        w8a8 = time_us(lambda: run(x, w13, s13, w2, s2, ids, weights, quantize_x=True)) if w8a8_ok else float("nan")
        bf16 = time_us(lambda: fused_experts_triton(x, w13b, w2b, ids, weights))
        with capsys.disabled():
            print(f"\n{layer} MoE layer, {tokens} tokens on {torch.cuda.get_device_name()}: fp8 w8a8 {w8a8:.1f} us, "
                  f"fp8 w8a16 {w8a16:.1f} us, bf16 {bf16:.1f} us (w8a8 / w8a16 {w8a8 / w8a16:.2f})")


def test_fp8_moe_checkpoint_fused_tokens_equal_the_dequantizing_torch_road(tmp_path, monkeypatch):
    """A tiny Qwen3-MoE quantized to 16 x 32 tiles (several scales per expert), float32: the fused kernel and
    the dequantized torch experts give the same greedy tokens."""
    from kestrel import LLM, SamplingParams
    from kestrel.envs import switches
    from kestrel.models.fp8_writer import write_fp8_checkpoint
    from tests.gpu.engine_tokens import PROMPTS
    from tests.test_moe_models import make_moe_checkpoint

    src = make_moe_checkpoint(tmp_path / "src", "qwen3_moe")
    path = write_fp8_checkpoint(src, tmp_path / "fp8", "hf", "block", (16, 32))
    tokens = {}
    for fused in (True, False):
        monkeypatch.setenv("KESTREL_FUSED_MOE", "1" if fused else "0")
        switches.cache_clear()
        llm = LLM(model=str(path), device="cuda", dtype="float32", cuda_graph_max_bs=8, max_num_seqs=8)
        try:
            params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
            tokens[fused] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
        finally:
            llm.shutdown()
            switches.cache_clear()
    assert tokens[True] == tokens[False]


def test_dummy_fp8_block_moe_shape_runs_with_graphs(tmp_path, monkeypatch):
    from benchmarks.shapes import write_config_only
    from benchmarks.step_profile import with_fp8_block_config
    from kestrel import LLM, SamplingParams
    from kestrel.envs import switches

    monkeypatch.setenv("KESTREL_FUSED_MOE", "1")
    switches.cache_clear()
    path = with_fp8_block_config(write_config_only("qwen3-moe-tiny", tmp_path / "tiny"))
    llm = LLM(model=str(path), device="cuda", load_format="dummy", cuda_graph_max_bs=8, max_num_seqs=8)
    try:
        assert llm.engine.runner.graphs is not None
        out = llm.generate([[5, 6, 7, 8]] * 3, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        assert all(len(o.outputs[0].token_ids) == 8 for o in out)
        assert out[0].outputs[0].token_ids == out[1].outputs[0].token_ids
    finally:
        llm.shutdown()
        switches.cache_clear()
