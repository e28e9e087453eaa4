"""benchmarks/step_profile.py: a batched decode step's time split, on the CPU with a tiny shape."""
from __future__ import annotations

import json

import pytest

from benchmarks.shapes import SHAPES
from benchmarks.step_profile import category, linear_cost, main


@pytest.mark.parametrize("name,expected", [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
    ("nvjet_tst_128x64_64x8_2x1_v_bz_coopB_TNT", "gemm"),
    ("_paged_decode_kernel", "attention"),
    ("_fused_moe_kernel", "moe"),
    ("_add_rms_norm_kernel", "norm/rope/act"),
    ("_logits_argmax_kernel", "sampling"),
    ("Memcpy DtoD (Device -> Device)", "copy"),
    ("some_new_kernel", "other"),
])
def test_kernels_fall_in_their_category(name, expected):
    assert category(name) == expected


def test_linear_cost_of_the_8b_shape_is_its_parameter_count():
    """Llama-3.1-8B: 7.5e9 parameters in linear layers and the head (the embedding is a lookup)."""
    flops, weight_bytes = linear_cost(SHAPES["llama-3.1-8b"], batch=128)
    params = weight_bytes / 2
    assert 7.4e9 < params < 7.6e9
    assert flops == pytest.approx(2 * params * 128)


def test_a_profiled_step_on_the_cpu_reports_fresh_prompts_and_its_split(tmp_path):
    out = tmp_path / "p.json"
    assert main(["--shape", "qwen3-moe-tiny", "--batch", "3", "--steps", "2", "--prompt-len", "20", "--device",
                 "cpu", "--workdir", str(tmp_path), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["running"] == 3 and report["prefix_cache_hit_rate"] == 0.0
    profile = report["profile"]
    assert profile["steps"] == 2 and profile["wall_ms"] > 0
    assert sum(profile["by_category_ms"].values()) == pytest.approx(profile["device_busy_ms"])


def test_fp8_moe_flag_sets_the_switch_the_engine_reads(tmp_path, monkeypatch):
    """--fp8-moe w8a8 sets KESTREL_FP8_MOE before the engine is built and the report records the switch read (on
    the CPU the experts still run the dequantizing reference: the W8A8 kernels are CUDA's)."""
    from kestrel.envs import switches

    monkeypatch.setenv("KESTREL_FP8_MOE", "w8a16")   # restored after the test, whatever main() writes
    out = tmp_path / "p.json"
    try:
        assert main(["--shape", "qwen3-moe-tiny", "--fp8-block", "--fp8-moe", "w8a8", "--batch", "2", "--steps", "1",
                     "--prompt-len", "8", "--device", "cpu", "--workdir", str(tmp_path), "--out", str(out)]) == 0
    finally:
        switches.cache_clear()
    report = json.loads(out.read_text())
    assert report["fp8_block"] and report["fp8_moe"] == "w8a8" and report["running"] == 2
