"""lab/scripts/gpu_suite.sh's control flow (its --dry-run prints each command) and its one table
(lab/suite_table.py), on CPU."""
import json
import os
import subprocess
import sys
from pathlib import Path

from lab.suite_table import suite_summary, suite_table

REPO = Path(__file__).resolve().parents[2]


def _bench(tok_s: float, c128: float, ttft: float, hf: bool = False) -> dict:
    res = {"ttft_128_ms": ttft, "kestrel": {"triton+graphs": {"bs1": {"tok_s": tok_s}, "c128": {"output_tok_s": c128}},
                                            "triton eager": {"bs1": {"tok_s": 1.0}, "c128": {"output_tok_s": 2.0}}}}
    if hf:
        res["hf_eager"] = {"bs1_tok_s": 14.5, "bs128_tok_s": 1785.9}
    return res


def _serve(single: float, peak: float, ttft_p50: float) -> dict:
    return {"config": {"model": "llama-3.1-8b"}, "runs": [
        {"name": "single", "summary": {"output_throughput": single}},
        {"name": "peak", "summary": {"output_throughput": peak}},
        {"name": "single-stream", "summary": {"output_throughput": single, "ttft_ms": {"p50": ttft_p50}}}]}


def test_the_table_sets_each_row_of_this_tree_against_the_baseline(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    (tmp_path / "suite.json").write_text(json.dumps({"gpu": "NVIDIA H200", "commit": "abc1234",
                                                     "baseline_src": "/x", "baseline_commit": "def5678",
                                                     "models": ["llama-3.1-8b"], "date": "2026-12-05"}))
    (raw / "bench_cur_llama-3.1-8b.json").write_text(json.dumps(
        {"gpu": "NVIDIA H200", "models": {"llama-3.1-8b": _bench(265.0, 18000.0, 4.8, hf=True)}}))
    # engine_bench.py's per-system parts beside the merged report are not read twice
    (raw / "bench_cur_llama-3.1-8b.llama-3.1-8b.kestrel.json").write_text(json.dumps(
        {"models": {"llama-3.1-8b": _bench(1.0, 1.0, 1.0)}}))
    (raw / "bench_base_llama-3.1-8b.json").write_text(json.dumps(
        {"models": {"llama-3.1-8b": _bench(250.0, 18000.0, 5.0)}}))
    (raw / "serve_cur.json").write_text(json.dumps(_serve(264.8, 18154.3, 7.2)))
    (raw / "serve_base.json").write_text(json.dumps(_serve(255.1, 17867.0, 6.7)))
    (raw / "http_overhead.json").write_text(json.dumps({"model": "/tmp/w/qwen3-0.6b", "max_tokens": 256,
                                                        "overhead_pct": -0.63}))
    (tmp_path / "tests.tsv").write_text("tests/gpu/a.py\t0\t3 passed\ntests/gpu/b.py\t1\t1 failed\n"
                                        "tests/gpu/c.py\tskip\t\n")
    summary = suite_summary(tmp_path)
    rows = {r["row"]: r for r in summary["rows"]}
    assert rows["llama-3.1-8b bs1 tok/s"]["current"] == 265.0 and rows["llama-3.1-8b bs1 tok/s"]["baseline"] == 250.0
    assert abs(rows["llama-3.1-8b bs1 tok/s"]["change_pct"] - 6.0) < 1e-9
    assert rows["llama-3.1-8b 128 concurrent out tok/s"]["change_pct"] == 0.0
    assert abs(rows["serve llama-3.1-8b TTFT p50 ms (streamed)"]["baseline"] - 6.7) < 1e-9
    table = suite_table(summary)
    assert table.splitlines()[0] == "GPU suite · NVIDIA H200 · commit abc1234 vs baseline def5678 · 2026-12-05"
    assert "| llama-3.1-8b bs1 tok/s | 265.0 | 250.0 | +6.0% |" in table
    assert "| llama-3.1-8b TTFT 128-token prompt ms | 4.80 | 5.00 | -4.0% |" in table
    assert "| llama-3.1-8b HF transformers eager bs1 / bs128 tok/s (same run) | 14.5 / 1,786 | — | — |" in table
    assert "| HTTP overhead per token % (qwen3-0.6b, 256 tokens) | -0.6 | — | — |" in table
    assert "| tests/gpu | 1/3 files passed; failed: b.py; 1 skipped (the suite's time budget was spent) | | |" in table


def test_without_a_baseline_the_table_has_one_column(tmp_path):
    (tmp_path / "bench_cur_qwen3-0.6b.json").write_text(json.dumps({"models": {"qwen3-0.6b": _bench(1559.9, 51380.0,
                                                                                                    1.26)}}))
    table = suite_table(suite_summary(tmp_path))
    assert "| row | value |" in table and "| qwen3-0.6b bs1 tok/s | 1,559.9 |" in table


def test_dry_run_alternates_the_trees_and_prints_the_table_last(tmp_path):
    base = tmp_path / "baseline"
    (base / "kestrel").mkdir(parents=True)
    (base / "COMMIT").write_text("def5678\n")
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "BASELINE_SRC": str(base), "STAGES": "bench serve tests",
           "GPU_TEST_FILES": "tests/gpu/test_cuda_parity.py", "HF": "1",
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    r = subprocess.run(["bash", "lab/scripts/gpu_suite.sh", "--dry-run"], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    commands = [line for line in r.stdout.splitlines() if line.startswith("[dry-run]")]
    bench = [c for c in commands if "benchmarks.engine_bench" in c]
    # 8B: baseline then current; 0.6B: current then baseline; the HF peer only in the current tree
    assert [(f"cd {base} " in c, "llama" in c) for c in bench] == [(True, True), (False, True), (False, False),
                                                                  (True, False)]
    assert all(("--skip-hf" in c) == (f"cd {base} " in c) for c in bench)
    assert all(f"PYTHONPATH={base}" in c for c in bench if f"cd {base} " in c)
    serve = [c for c in commands if "kestrel.cli launch" in c]
    assert len(serve) == 2 and f"env -C {base} PYTHONPATH={base}" in serve[0] and "serve_cur.json" in serve[1]
    assert "pytest" in commands[-1] and "tests/gpu/test_cuda_parity.py" in commands[-1]
    assert r.stdout.rstrip().splitlines()[-1].startswith("| tests/gpu | 1/1 files passed")
    assert "vs baseline def5678" in r.stdout
    assert sorted(p.name for p in out.iterdir()) == ["suite.json", "suite.log", "summary.json", "summary.md",
                                                     "tests.tsv"]


def test_the_ttft_stage_runs_the_breakdown_per_shape_and_adds_its_rows(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "STAGES": "ttft",
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    r = subprocess.run(["bash", "lab/scripts/gpu_suite.sh", "--dry-run"], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    runs = [line for line in r.stdout.splitlines() if "benchmarks.ttft_breakdown" in line]
    assert len(runs) == 2 and "llama-3.1-8b" in runs[0] and "qwen3-0.6b" in runs[1]
    assert all("--device cuda" in c and "/raw/ttft_" in c for c in runs)

    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "ttft_llama-3.1-8b.json").write_text(json.dumps(
        {"model": "llama-3.1-8b", "root": "/tmp/kestrel-bench/llama-3.1-8b", "prompt_len": 128,
         "client_ttft_ms_p50": 9.81, "server_ttft_ms_p50": 8.9,
         "stages_ms_p50": {"http_parse": 0.1, "prefill": 8.0}}))
    table = suite_table(suite_summary(tmp_path))
    assert "| llama-3.1-8b TTFT ms through kestrel serve, client (fresh 128-token prompt, streamed p50) | 9.81 |" \
        in table
    assert "| llama-3.1-8b TTFT ms in the server by stage (http_parse 0.10, prefill 8.00) | 8.90 |" in table
