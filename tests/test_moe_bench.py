"""benchmarks/moe_bench.py --quick end to end on the CPU (tiny Qwen3-MoE and DeepSeek-V3 shapes, dummy weights):
the report has every figure the GPU run fills in and the roofline arithmetic holds."""
from __future__ import annotations

import json

import pytest

from benchmarks import moe_bench
from benchmarks.moe_roofline import expected_touched_experts


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
