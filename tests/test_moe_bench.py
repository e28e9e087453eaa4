"""benchmarks/moe_bench.py --quick end to end on the CPU (tiny Qwen3-MoE and DeepSeek-V3 shapes, dummy weights):
the report has every figure the GPU run fills in, the roofline arithmetic holds, and the table prints it; and
scripts/moe_gpu.sh's control flow runs without a GPU (--dry-run)."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from benchmarks import moe_bench, moe_table
from benchmarks.moe_roofline import expected_touched_experts

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("shape", ["qwen3-moe-tiny", "deepseek-v3-tiny"])
def test_quick_run_reports_every_figure(tmp_path, shape):
    out = tmp_path / f"{shape}.json"
    # 40-token prompts: two cacheable blocks each, so a prompt sent twice would show as hits
    assert moe_bench.main(["--quick", "--shape", shape, "--out", str(out), "--workdir", str(tmp_path),
                           "--prompt-len", "40"]) == 0
    r = json.loads(out.read_text())
    assert r["load_format"] == "dummy" and r["device"] == "cpu" and "error" not in r
    assert r["experts_impl"].endswith("fused_experts_torch")
    roof = r["roofline"]
    c = r["workload"]["concurrency"]
    for figure in (r["bs1"]["decode_tok_s"], r[f"c{c}"]["output_tok_s"], r[f"c{c}"]["decode_tok_s"],
                   roof["bs1_roofline_tok_s"], roof[f"c{c}_roofline_tok_s"], r["copy_bandwidth_gb_s"]):
        assert figure > 0
    assert r["bs1"]["fraction_of_roofline"] == pytest.approx(r["bs1"]["decode_tok_s"] / roof["bs1_roofline_tok_s"])
    assert r[f"c{c}"]["output_tokens"] == c * r["workload"]["output_len"]
    # every timed prompt new (the warm-ups' never re-sent): the hit rate is there and nothing hit
    assert r["bs1"]["prefix_cache_hit_rate"] == 0.0 and r[f"c{c}"]["prefix_cache_hit_rate"] == 0.0
    assert r[f"c{c}"]["prefix_cache_query_tokens"] == c * r["workload"]["prompt_len"]
    assert r["bs1"]["output_tokens"] == r["workload"]["bs1_prompts"] * r["workload"]["output_len"]
    # bs1 reads k of E experts a sparse layer, c sequences at most all of them
    experts, k = (8, 2)
    assert roof["active_weight_bytes_per_token"] == round(r["weight_bytes"] - r["expert_bytes"] * (1 - k / experts)
                                                          - _embedding_rows_not_read(r["config"]))
    assert roof[f"c{c}_expected_touched_experts_per_layer"] == pytest.approx(expected_touched_experts(8, 2, c))
    if shape.startswith("deepseek"):   # MLA: one latent (32 + 8) a layer, under GQA's K and V of 4 heads of 16
        assert r["kv_bytes_per_token"] == 2 * 40 * 4
        assert r["kv_bytes_per_token"] < min(r["kv_bytes_per_token_same_width"].values())
    else:
        assert r["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4   # layers x K,V x KV heads x head_dim x fp32
    profile = r["bs1_kernel_profile"]
    assert "error" not in profile and profile["us_per_step"] > 0 and profile["top"][0]["name"]
    text = moe_table.table({shape: r})
    assert "bs1 decode tok/s" in text and shape in text


def _embedding_rows_not_read(cfg: dict) -> int:
    """engine_bench.decode_weight_bytes: an untied input embedding counts one row (float32 on the CPU)."""
    return (cfg["vocab_size"] - 1) * cfg["hidden_size"] * 4


def test_touched_experts_formula():
    assert expected_touched_experts(128, 8, 1) == pytest.approx(8)
    assert 127.9 < expected_touched_experts(128, 8, 128) < 128
    assert expected_touched_experts(64, 6, 2) == pytest.approx(64 * (1 - (58 / 64) ** 2))


def test_a_failed_stage_is_in_the_report(tmp_path, monkeypatch):
    out = tmp_path / "r.json"
    monkeypatch.setattr(moe_bench, "single_stream", lambda *a, **k: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        moe_bench.main(["--quick", "--out", str(out), "--workdir", str(tmp_path)])
    r = json.loads(out.read_text())
    assert "ZeroDivisionError" in r["error"] and r["roofline"]["bs1_roofline_tok_s"] > 0
    assert "ZeroDivisionError" in moe_table.table(moe_table.load([str(out)]))


def test_gpu_script_dry_run_runs_tests_then_both_shapes_then_the_table(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path))
    proc = subprocess.run(["bash", "scripts/moe_gpu.sh", "--dry-run"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    commands = [line for line in proc.stdout.splitlines() if line.startswith("+ ")]
    assert "tests/gpu/test_moe_gpu.py" in commands[0] and "timeout" in commands[0]
    assert "--shape qwen3-30b-a3b" in commands[1] and "--shape deepseek-v3-small" in commands[2]
    assert all("timeout" in c for c in commands[:3])
    assert "benchmarks.moe_table" in commands[-1]
    assert "NCCL_NVLS_ENABLE=0" in (ROOT / "scripts/moe_gpu.sh").read_text()
