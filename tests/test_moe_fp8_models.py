"""Block-FP8 MoE checkpoints (Qwen3-30B-A3B-FP8's format) load with FP8 experts and compute what their dequantized
weights compute: tiny random Qwen3-MoE / Mixtral checkpoints quantized by `kestrel quantize` (every projection and
expert to E4M3 with one float32 scale per tile, the router left float), against HF transformers float32 on the same
weights dequantized by the test itself (tests/test_fp8.py's independent reference). On the CPU the experts are
dequantized exactly (float32): prompt logits within 1e-4 of the largest, greedy tokens identical."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from kestrel import LLM
from kestrel.errors import KestrelError
from kestrel.kernels.fp8_quant import FP8
from kestrel.layers.moe import FusedExperts
from kestrel.layers.moe_fp8 import Fp8Experts, Fp8StackedWeight
from kestrel.models.fp8_writer import write_fp8_checkpoint
from tests.test_fp8 import assert_matches_reference, float_reference


def experts_of(llm: LLM) -> dict[str, FusedExperts]:
    return {n: m for n, m in llm.engine.runner.model.named_modules() if isinstance(m, FusedExperts)}


def quantize(src: Path, out: Path, *args: str) -> Path:
    from kestrel.cli import main

    assert main(["quantize", str(src), str(out), *args]) == 0
    return out


@pytest.mark.parametrize("name,block", [("qwen3_moe", "16 32"),
                                        pytest.param("qwen3_moe", "128 128", marks=pytest.mark.slow),
                                        pytest.param("mixtral", "32 16", marks=pytest.mark.slow)])
def test_fp8_moe_checkpoint_keeps_fp8_experts_and_matches_hf_on_its_dequantized_weights(moe_checkpoint, tmp_path,
                                                                                       name, block):
    """Small tiles give each expert several scales along both dims (a misplaced scale shows); 128 x 128 is the
    released checkpoints' tile, larger than these experts (one short tile each)."""
    out = quantize(moe_checkpoint(name), tmp_path / "fp8", "--block", *block.split())
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        expert = next(n for n in names if ".experts.0." in n and n.endswith(".weight"))
        assert f.get_tensor(expert).dtype == FP8 and expert.removesuffix("weight") + "weight_scale_inv" in names
        router = next(n for n in names if n.endswith(".gate.weight"))
        assert f.get_tensor(router).dtype == torch.float32   # the router stays float
    llm = LLM(model=str(out), device="cpu")
    try:
        experts = experts_of(llm)
        assert experts and all(m.w13.weight.dtype == FP8 and m.w2.weight.dtype == FP8 for m in experts.values())
        assert all(isinstance(m.impl, Fp8Experts) for m in experts.values())
        assert_matches_reference(llm, float_reference(out, tmp_path / "ref"))
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_moe_block_named_in_modules_to_not_convert_keeps_float_experts(moe_checkpoint, tmp_path):
    """modules_to_not_convert naming one layer's MoE block leaves that layer's experts float (bf16/fp32 in the
    file, float stacked weights in the model) and the other layers' FP8; naming a router (Qwen3-30B-A3B-FP8 lists
    every model.layers.N.mlp.gate) leaves its experts FP8."""
    out = tmp_path / "fp8"
    ignore = ("model.layers.0.mlp", "model.layers.2.mlp.gate")
    write_fp8_checkpoint(moe_checkpoint("qwen3_moe"), out, "hf", "block", (16, 32), ignore)
    assert json.loads((out / "config.json").read_text())["quantization_config"]["modules_to_not_convert"] == [
        *ignore]
    llm = LLM(model=str(out), device="cpu")
    try:
        experts = experts_of(llm)
        assert not isinstance(experts["layers.0.mlp.experts"].w13, Fp8StackedWeight)
        assert experts["layers.0.mlp.experts"].w13.weight.dtype == torch.float32
        assert experts["layers.2.mlp.experts"].w13.weight.dtype == FP8
        assert_matches_reference(llm, float_reference(out, tmp_path / "ref"))
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_fp8_moe_at_tp2_equals_one_rank(moe_checkpoint, tmp_path):
    """Each rank's experts hold their slice of I = 32 (16 each, on 16-row / 16-column tiles) with its scales."""
    from tests.test_fp8 import assert_tp2_matches_one_rank

    out = quantize(moe_checkpoint("qwen3_moe"), tmp_path / "fp8", "--block", "16", "16")
    assert_tp2_matches_one_rank(dict(model=str(out)))


@pytest.mark.slow
def test_tp_split_of_the_experts_that_cuts_a_tile_is_refused_naming_the_tensor_and_rank_counts(moe_checkpoint,
                                                                                                tmp_path):
    """I = 32 over 2 ranks starts rank 1 at column 16, inside a 32-wide tile."""
    out = quantize(moe_checkpoint("qwen3_moe"), tmp_path / "fp8", "--block", "32", "32")
    with pytest.raises(KestrelError, match=r"experts\.\d+\.(gate|up|down)_proj\.weight_scale_inv: FP8 block scales "
                       r"of \[32, 32\] do not line up .* over 2 ranks cuts a 32-wide tile; it splits on tile "
                       r"boundaries over 1 rank"):
        LLM(model=str(out), device="cpu", tensor_parallel_size=2)
