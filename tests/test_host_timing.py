"""benchmarks/host_timing.py: the bs1 bench's step intervals and garbage-collector pauses, and the bench's
single_stream on a real (tiny, CPU) engine."""
from __future__ import annotations

import gc

from benchmarks.engine_bench import single_stream
from benchmarks.host_timing import GcPauses, interval_summary
from kestrel.config import EngineConfig
from kestrel.engine.engine import Engine


def test_gc_pauses_records_each_collection_by_generation():
    with GcPauses() as pauses:
        gc.collect(0)
        gc.collect(2)
        gc.collect(2)
    summary = pauses.summary()
    assert summary["0"]["count"] >= 1 and summary["2"]["count"] >= 2
    assert summary["2"]["total_ms"] >= summary["2"]["max_ms"] >= 0
    gc.collect()
    assert len(pauses.pauses) == sum(s["count"] for s in summary.values())   # the callback was removed


def test_interval_summary_counts_only_the_long_stalls():
    s = interval_summary([0.004] * 98 + [0.010, 0.020])
    assert s["count"] == 100 and s["median_ms"] == 4.0 and s["max_ms"] == 20.0
    assert s["slow_count"] == 2 and abs(s["slow_excess_ms"] - 22.0) < 1e-9
    assert interval_summary([]) == {}


def test_single_stream_reports_one_interval_per_decode_step(checkpoint_factory):
    engine = Engine(EngineConfig(model=str(checkpoint_factory("llama")), device="cpu"))
    r = single_stream(engine, [[5, 6, 7, 8], [9, 10, 11]], max_tokens=6)
    assert r["tok_s"] > 0 and r["decode_tok_s"] > 0
    # the prefill's step gives the first token and starts the clock; each of the 5 decode steps adds an interval
    assert r["step_intervals"]["count"] == 2 * (6 - 1)
    assert isinstance(r["gc_pauses"], dict)
