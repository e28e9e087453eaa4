"""lab/multi_gpu_table.py: the multi-GPU suite's table from its steps' files, partial runs included."""
from __future__ import annotations

import json

from lab.multi_gpu_table import build, render


def engine_report(tp: int, bs1: float, nccl: bool = False, symm: bool = True) -> dict:
    return {"gpu": "NVIDIA H100 80GB HBM3", "tensor_parallel_size": tp, "models": {"llama-3.1-8b": {
        "tensor_parallel_size": tp, "disable_custom_all_reduce": nccl, "custom_all_reduce": symm and not nccl,
        "startup_s": 20.0 + tp, "ttft_128_ms": 5.0 / tp,
        "kestrel": {"triton+graphs": {"bs1": {"tok_s": bs1, "decode_tok_s": bs1 + 1},
                                      "c128": {"output_tok_s": 9000.0 * tp}}}}}}


def all_reduce_report(world: int) -> dict:
    roads = {"nccl": {"graph_us": 12.0, "eager_us": 20.0, "correct": True},
             "symm": {"graph_us": 5.0, "eager_us": 9.0, "correct": True, "matches_nccl": True}}
    big = {"nccl": {"graph_us": 80.0, "eager_us": 85.0, "correct": True},
           "symm": {"applicable": False, "reason": "routed to NCCL"}}
    return {"world_size": world, "gpu": "NVIDIA H100 80GB HBM3", "symm_open": True, "complete": True,
            "sizes": [{"bytes": 8192, "route": "one_shot", "roads": roads},
                      {"bytes": 8 << 20, "route": "nccl", "roads": big}],
            "decode_step_8b": {"us_per_step": {"nccl_graph": 65 * 12.0, "symm_graph": 65 * 5.0}}}


def test_rows_speedups_targets_and_the_all_reduce_table(tmp_path):
    for name, report in {"bench_tp1": engine_report(1, 250.0), "bench_tp2": engine_report(2, 400.0),
                         "bench_tp4": engine_report(4, 500.0), "bench_tp4_nccl": engine_report(4, 450.0, nccl=True),
                         "ar_tp4": all_reduce_report(4)}.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(report))
    (tmp_path / "bench_tp2.llama-3.1-8b.kestrel.json").write_text(json.dumps(engine_report(2, 1.0)))   # a part
    (tmp_path / "sigterm.json").write_text(json.dumps({"tensor_parallel_size": 4, "ok": True, "exit_s": 2.1,
                                                       "returncode": 0, "workers_seen": 3, "left_behind": []}))
    (tmp_path / "tests.log").write_text("....\n4 passed in 61.2s\nrc=0\n")
    summary = build(tmp_path, "llama-3.1-8b")
    assert [(r["tp"], r["disable_custom_all_reduce"]) for r in summary["rows"]] == [
        (1, False), (2, False), (4, False), (4, True)]
    assert [round(r["speedup"], 2) for r in summary["rows"]] == [1.0, 1.6, 2.0, 1.8]
    assert [t["met"] for t in summary["targets"]] == [True, False]   # 1.6x >= 1.5x; 2.0x < 2.2x
    assert summary["rows"][2]["ar_step_us_symm"] == 325.0 and summary["rows"][1]["ar_step_us_symm"] is None
    text = render(summary)
    assert "| 4 | NCCL (flag) | 450.0 | 1.80x |" in text and "| 4 | symm + NCCL | 500.0 | 2.00x |" in text
    assert "| 8 KB | one_shot | 12.0 (20.0) | 5.0 (9.0) | yes |" in text
    assert "| 8 MiB | nccl | 80.0 (85.0) | n/a |" in text
    assert "TP=4 >= 2.2x TP=1: 2.00x, NOT met" in text and "SIGTERM at TP=4: ok" in text
    assert "4 passed in 61.2s" in text


def test_missing_and_failed_runs_show_as_such(tmp_path):
    (tmp_path / "bench_tp2.json").write_text(json.dumps(
        {"models": {"llama-3.1-8b": {"kestrel_error": "benchmark process wrote no report: boom"}}}))
    (tmp_path / "bench_tp1.json").write_text("{not json")
    (tmp_path / "bench_tp4.log").write_text("killed by the step's timeout\nrc=124\n")   # no report beside it
    (tmp_path / "ar_tp4.log").write_text("error: --device cuda: no CUDA device is visible\nrc=2\n")
    text = render(build(tmp_path, "llama-3.1-8b"), tmp_path)
    assert "| 1 | — | error: no report" in text and "error: benchmark process wrote no report: boom" in text
    assert "TP=2 >= 1.5x TP=1: —, not measured" in text
    assert "| 4 | ? | error: no report (the run did not finish: killed by the step's timeout)" in text
    assert "all-reduce bench at 4 ranks: no report (error: --device cuda: no CUDA device is visible)" in text
    assert "SIGTERM check: did not run" in text and "test_tp_gpu.py: did not run" in text
