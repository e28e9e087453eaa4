"""Block-FP8 experts on CUDA (issue 51): the fused Triton MoE kernel reading FP8 weights with their 128 x 128 tile
scales (W8A16) against the dequantized torch oracle (layers/moe_fp8.py: fp8_experts_reference) at Qwen3-30B-A3B's
layer shape, M = 1, 16, 128, 256 tokens, both paths; no host sync and a CUDA-graph replay; an FP8 MoE checkpoint's
greedy tokens with the fused kernel equal to the dequantizing torch road's; a dummy FP8 MoE shape served with graphs.

Same contract as tests/test_fused_moe_fp8.py (there under Triton's interpreter). Written without a GPU at hand.
Bounds: the kernel widens each FP8 tile to x's dtype with its scale exactly as the oracle's dequantize does, so both
multiply the same bf16 weights; the rest is the float kernel's bf16 bound (tests/gpu/test_moe_gpu.py), and float32
within 1e-5 (summation order only)."""
from __future__ import annotations

import pytest
import torch

from kestrel.layers.moe_fp8 import dequantize_stacked, fp8_experts_reference, quantize_stacked
from tests.gpu.test_moe_gpu import LAYERS, assert_close_bf16, problem
from tests.gpu.timing import time_us

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BLOCK = (128, 128)


def fp8_problem(tokens: int, layer: str = "qwen3-30b-a3b", seed: int = 0, dtype: torch.dtype = torch.bfloat16):
    experts, topk, hidden, inter = LAYERS[layer]
    x, w13, w2, ids, weights = problem(tokens, experts, topk, hidden, inter, seed=seed, dtype=torch.float32)
    w13_8, s13 = quantize_stacked(w13, BLOCK, parts=2)
    w2_8, s2 = quantize_stacked(w2, BLOCK, parts=1)
    return x.to(dtype), w13_8, s13, w2_8, s2, ids, weights


def run(x, w13, s13, w2, s2, ids, weights, path=None):
    from kestrel.kernels.triton.fused_moe import fused_experts_triton

    return fused_experts_triton(x, w13, w2, ids, weights, path=path, w13_scale=s13, w2_scale=s2, block=BLOCK)


@pytest.mark.parametrize("path", ["rows", "tiles", None])
@pytest.mark.parametrize("tokens", [1, 16, 128, 256])
@pytest.mark.parametrize("layer", list(LAYERS))
def test_fp8_fused_moe_matches_the_dequantized_reference(layer, tokens, path):
    if path == "rows" and tokens > 16:
        pytest.skip("the rows path serves decode-sized batches")
    x, w13, s13, w2, s2, ids, weights = fp8_problem(tokens, layer, seed=tokens)
    assert_close_bf16(run(x, w13, s13, w2, s2, ids, weights, path),
                      fp8_experts_reference(x, w13, w2, ids, weights, s13, s2, BLOCK))


@pytest.mark.parametrize("path", ["rows", "tiles"])
def test_fp8_fused_moe_float32_is_near_exact(path):
    x, w13, s13, w2, s2, ids, weights = fp8_problem(16, seed=3, dtype=torch.float32)
    ref = fp8_experts_reference(x, w13, w2, ids, weights, s13, s2, BLOCK)
    torch.testing.assert_close(run(x, w13, s13, w2, s2, ids, weights, path), ref, rtol=1e-5,
                               atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("tokens", [1, 8, 128])
def test_fp8_fused_moe_makes_no_host_sync_and_replays_in_a_graph(tokens):
    x, w13, s13, w2, s2, ids, weights = fp8_problem(tokens, seed=5)
    run(x, w13, s13, w2, s2, ids, weights)   # compile first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run(x, w13, s13, w2, s2, ids, weights)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(x, w13, s13, w2, s2, ids, weights)
    x2, *_, ids2, weights2 = fp8_problem(tokens, seed=6)
    x.copy_(x2)
    ids.copy_(ids2)
    weights.copy_(weights2)
    graph.replay()
    torch.cuda.synchronize()
    assert_close_bf16(out, fp8_experts_reference(x, w13, w2, ids, weights, s13, s2, BLOCK))


def test_fp8_moe_layer_times_printed(capsys):
    """Informative: one Qwen3-30B-A3B MoE layer, FP8 (W8A16) against bf16, at 1 and 128 tokens."""
    from kestrel.kernels.triton.fused_moe import fused_experts_triton

    for tokens in (1, 128):
        x, w13, s13, w2, s2, ids, weights = fp8_problem(tokens, seed=7)
        w13b = dequantize_stacked(w13, s13, BLOCK, 2).to(torch.bfloat16)
        w2b = dequantize_stacked(w2, s2, BLOCK, 1).to(torch.bfloat16)
        fp8 = time_us(lambda: run(x, w13, s13, w2, s2, ids, weights))
        bf16 = time_us(lambda: fused_experts_triton(x, w13b, w2b, ids, weights))
        with capsys.disabled():
            print(f"\nqwen3-30b-a3b MoE layer, {tokens} tokens on {torch.cuda.get_device_name()}: "
                  f"fp8 {fp8:.1f} us, bf16 {bf16:.1f} us")


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
