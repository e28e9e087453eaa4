"""benchmarks/cold_start.py against a real `kestrel serve` of the default model on the CPU: every compile cache
points at a fresh directory, the server's /health reports seconds per startup phase, and fresh-prompt TTFTs are
timed through the stream."""
from __future__ import annotations

import os
from pathlib import Path

from benchmarks.cold_start import CACHE_VARIABLES, cold_environment, measure
from kestrel.config import DEFAULT_MODEL_DIR


def test_cold_environment_points_every_cache_at_a_fresh_directory(tmp_path):
    env = cold_environment(tmp_path)
    for name in CACHE_VARIABLES:
        assert Path(env[name]).is_dir() and not os.listdir(env[name]) and env[name].startswith(str(tmp_path))


def test_cold_start_reports_phases_and_fresh_prompt_ttft():
    r = measure(str(DEFAULT_MODEL_DIR), "cpu", 8143, prompt_len=16, requests=2, serve_args=[], timeout_s=180)
    phases = r["phases_s"]
    for phase in ("starting", "resolving_model", "loading_weights", "warming_up"):
        assert phases.get(phase, -1) >= 0, phases
    assert 0 < sum(phases.values()) <= r["ready_s"] + 0.5
    assert len(r["ttft_ms"]) == 2 and all(t > 0 for t in r["ttft_ms"])
    assert r["graph_memory_gib"] is None and r["cuda_graph_max_bs"] is None   # no CUDA graphs on the CPU
    # the timed requests' hit rate from the server's /metrics: fresh prompts, nothing cached
    assert r["prefix_cache_hit_rate"] == 0.0 and r["prefix_cache"]["queries"] == 2 * 16


def test_graph_capture_size_and_device_wide_memory_come_from_the_capture_line():
    from benchmarks.cold_start import graph_max_bs, graph_memory_device_gib, graph_memory_gib

    log = ("INFO captured 35 decode graphs (batch sizes [1, 2, 4, 8, 256]) and 3 prefill graphs (tokens [16, 32, "
           "64]) in 3.1 s; graphs hold 0.41 GiB (allocator; 0.50 GiB device-wide)")
    assert (graph_max_bs(log), graph_memory_gib(log), graph_memory_device_gib(log)) == (256, 0.41, 0.50)
    assert graph_max_bs("no capture") is None
