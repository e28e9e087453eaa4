"""benchmarks/ab_summary.py on real files laid out as scripts/gpu_suite.sh's profile stage writes them."""
from __future__ import annotations

import json
from pathlib import Path

from benchmarks.ab_summary import ab_rows, best_switch, markdown, read_switches


def _write(out: Path, name: str, model: str, step_ms: float) -> None:
    kernels = [{"name": "_skinny_matmul_kernel", "exposed_us_each": 3.5}]
    (out / name).write_text(json.dumps([{"model": model, "engine_step_ms": step_ms, "kernels": kernels}]))


def test_rows_and_the_fastest_switch_that_gained_one_percent(tmp_path):
    _write(tmp_path, "profile.json", "qwen3-0.6b", 0.700)
    _write(tmp_path, "profile_ab_qwen3-0.6b_A_1_B_2.json", "qwen3-0.6b", 0.680)     # -2.9%
    _write(tmp_path, "profile_ab_qwen3-0.6b_C_1.json", "qwen3-0.6b", 0.690)         # -1.4%
    _write(tmp_path, "profile_ab_qwen3-0.6b_D_1.json", "qwen3-0.6b", 0.720)         # +2.9%
    _write(tmp_path, "profile_ab_llama-3.1-8b_E_1.json", "llama-3.1-8b", 1.0)      # no baseline: left out
    (tmp_path / "switches.txt").write_text("qwen3-0.6b_A_1_B_2 A=1+B=2\nqwen3-0.6b_C_1 C=1\nqwen3-0.6b_D_1 D=1\n")
    rows = ab_rows(tmp_path)
    assert sorted(r["switch"] for r in rows) == ["A_1_B_2", "C_1", "D_1"]
    assert "| qwen3-0.6b | A_1_B_2 | 0.680 | 0.700 | -2.9% | 3.50 |  |" in markdown(rows)
    switches = read_switches(tmp_path / "switches.txt")
    assert best_switch(rows, switches) == "A=1+B=2"                          # as written in the A/B list
    assert best_switch(rows, switches, min_gain_pct=3.0) is None            # nothing gained 3%
    assert best_switch([r for r in rows if r["switch"] == "D_1"], switches) is None   # a loss never wins


def test_the_profiles_own_switches_are_never_the_switch_to_bench(tmp_path):
    """KESTREL_PROFILE_ABLATE takes work out of the step, so it is always faster, and KESTREL_PROFILE_LIKE_BENCH
    changes the profiled engine, not the bench's: neither is a candidate."""
    _write(tmp_path, "profile.json", "qwen3-0.6b", 0.700)
    _write(tmp_path, "profile_ab_qwen3-0.6b_KESTREL_PROFILE_ABLATE_decode.json", "qwen3-0.6b", 0.530)   # -24%
    _write(tmp_path, "profile_ab_qwen3-0.6b_KESTREL_PROFILE_LIKE_BENCH_1.json", "qwen3-0.6b", 0.600)    # -14%
    _write(tmp_path, "profile_ab_qwen3-0.6b_C_1.json", "qwen3-0.6b", 0.690)                            # -1.4%
    (tmp_path / "switches.txt").write_text("qwen3-0.6b_KESTREL_PROFILE_ABLATE_decode KESTREL_PROFILE_ABLATE=decode\n"
                                           "qwen3-0.6b_KESTREL_PROFILE_LIKE_BENCH_1 KESTREL_PROFILE_LIKE_BENCH=1\n"
                                           "qwen3-0.6b_C_1 C=1\n")
    switches = read_switches(tmp_path / "switches.txt")
    rows = ab_rows(tmp_path)
    assert len(rows) == 3 and best_switch(rows, switches) == "C=1"
    assert best_switch([r for r in rows if "PROFILE" in r["switch"]], switches) is None
