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
    assert r["graph_memory_gib"] is None   # no CUDA graphs on the CPU
