"""benchmarks/all_reduce_bench.py on the CPU: two real gloo rank processes time the all-reduce and check its sums,
rank 0's JSON carries the 8B decode-step estimate, and a SIGTERM to the starter leaves no rank behind. (The NCCL
and symmetric-memory roads need GPUs: the same benchmark runs them on a multi-GPU host.)"""
from __future__ import annotations

import pytest

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from benchmarks.all_reduce_bench import STEP_ALL_REDUCES, STEP_MESSAGE_BYTES, parse_size

ROOT = Path(__file__).resolve().parents[1]


def bench(out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "benchmarks.all_reduce_bench", "--device", "cpu", "--world-size", "2",
            "--out", str(out), *extra]


@pytest.mark.slow
def test_two_gloo_ranks_report_positive_times_correct_sums_and_the_step_estimate(tmp_path):
    out = tmp_path / "ar.json"
    run = subprocess.run(bench(out, "--sizes", "8K,32K", "--graph-ops", "10", "--replays", "3"), cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["world_size"] == 2 and report["backend"] == "gloo" and report["complete"]
    assert report["correct"] is True
    assert [s["bytes"] for s in report["sizes"]] == [8192, 32768]
    for size in report["sizes"]:
        road = size["roads"]["gloo"]
        assert road["correct"] is True and road["eager_us"] > 0 and road["graph_us"] is None
        assert "symm" not in size["roads"]   # no symmetric memory on the CPU
    step = report["decode_step_8b"]
    assert step["all_reduces"] == STEP_ALL_REDUCES == 65 and step["message_bytes"] == STEP_MESSAGE_BYTES
    assert step["us_per_step"]["gloo_eager"] == STEP_ALL_REDUCES * report["sizes"][0]["roads"]["gloo"]["eager_us"]
    assert report["env"]["NCCL_NVLS_ENABLE"] == "0" and report["env"]["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    assert "8 KB" in run.stdout and "32 KB" in run.stdout   # one progress line per size


@pytest.mark.slow
def test_the_step_size_is_always_measured(tmp_path):
    out = tmp_path / "ar.json"
    run = subprocess.run(bench(out, "--sizes", "64K", "--graph-ops", "5", "--replays", "2"), cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    assert [s["bytes"] for s in json.loads(out.read_text())["sizes"]] == [8192, 65536]


@pytest.mark.slow
def test_sigterm_to_the_starter_stops_every_rank_and_marks_the_report_incomplete(tmp_path):
    out = tmp_path / "ar.json"
    proc = subprocess.Popen(bench(out, "--sizes", "8K,16M,32M,64M", "--replays", "50"), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 30
        while not out.is_file() and time.monotonic() < deadline:   # rank 0 has written its first size
            time.sleep(0.1)
        ranks = psutil.Process(proc.pid).children()
        assert len(ranks) == 2
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, output
    _, alive = psutil.wait_procs(ranks, timeout=10)
    assert alive == []
    report = json.loads(out.read_text())
    assert report["complete"] is False and "signal" in report["error"] and report["sizes"]


def test_sizes_parse_with_binary_suffixes():
    assert [parse_size(s) for s in ("8K", "2M", "512", "1.5M", "8KiB")] == [8192, 2 << 20, 512, 3 << 19, 8192]
