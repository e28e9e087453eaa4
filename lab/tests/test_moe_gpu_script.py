"""lab/scripts/moe_gpu.sh's control flow without a GPU (--dry-run), and lab/moe_table.py's table of
benchmarks/moe_bench.py reports (a --quick CPU run, and a report a failed stage wrote)."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from benchmarks import moe_bench
from lab import moe_table

ROOT = Path(__file__).resolve().parents[2]


def test_the_table_prints_a_quick_report(tmp_path):
    out = tmp_path / "r.json"
    assert moe_bench.main(["--quick", "--shape", "qwen3-moe-tiny", "--out", str(out), "--workdir", str(tmp_path)]) == 0
    text = moe_table.table(moe_table.load([str(out)]))
    assert "bs1 decode tok/s" in text and "qwen3-moe-tiny" in text


def test_the_table_shows_a_failed_stage(tmp_path, monkeypatch):
    out = tmp_path / "r.json"
    monkeypatch.setattr(moe_bench, "single_stream", lambda *a, **k: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        moe_bench.main(["--quick", "--out", str(out), "--workdir", str(tmp_path)])
    assert "ZeroDivisionError" in moe_table.table(moe_table.load([str(out)]))
    assert "no report" in moe_table.table(moe_table.load([str(tmp_path / "missing.json")]))


def test_gpu_script_dry_run_runs_tests_then_both_shapes_then_the_table(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path))
    proc = subprocess.run(["bash", "lab/scripts/moe_gpu.sh", "--dry-run"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    commands = [line for line in proc.stdout.splitlines() if line.startswith("+ ")]
    assert "tests/gpu/test_moe_gpu.py" in commands[0] and "timeout" in commands[0]
    assert "--shape qwen3-30b-a3b" in commands[1] and "--shape deepseek-v3-small" in commands[2]
    assert all("timeout" in c for c in commands[:3])
    assert "lab.moe_table" in commands[-1]
    assert "NCCL_NVLS_ENABLE=0" in (ROOT / "lab/scripts/moe_gpu.sh").read_text()
