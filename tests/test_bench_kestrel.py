"""The benchmark against the real thing: `kestrel launch -- kestrel serve` then `bench serve`, and `bench offline`.

Uses the embedded default model when it is on disk, else a tiny random-weight checkpoint (conftest).
"""
from __future__ import annotations

import json
import shlex
import socket
import sys

import pytest

from kestrel.config import DEFAULT_MODEL_DIR
from kestrel.cli import main

pytest.importorskip("kestrel.server.app")


@pytest.fixture(scope="module")
def model_dir(checkpoint_factory) -> str:
    return str(DEFAULT_MODEL_DIR) if (DEFAULT_MODEL_DIR / "config.json").exists() else str(checkpoint_factory())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_launch_kestrel_serve_then_single_and_peak(tmp_path, model_dir):
    out = tmp_path / "kestrel.json"
    port = _free_port()
    kestrel = f"{shlex.quote(sys.executable)} -m kestrel.cli"
    bench = (f"{kestrel} bench serve --base-url {{base_url}} --preset single-and-peak --output-len 4 "
             f"--num-prompts 4 --concurrency 4 --no-progress --tokenizer {shlex.quote(model_dir)} --output {out}")
    code = main(["launch", "--log-file", str(tmp_path / "serve.log"), "--ready-timeout", "180",
                 "--stall-timeout", "90", "--grace", "5", "--then", bench, "--",
                 sys.executable, "-m", "kestrel.cli", "serve", model_dir, "--device", "cpu", "--port", str(port)])
    assert code == 0, (tmp_path / "serve.log").read_text()[-2000:]
    result = json.loads(out.read_text())
    assert [r["name"] for r in result["runs"]] == ["single", "peak", "single-stream", "peak-stream"]
    for run in result["runs"]:
        assert run["summary"]["failed"] == 0, run["summary"]["errors"]
        assert all(r["output_tokens"] == 4 and r["token_source"] == "usage" for r in run["requests"])
    streamed = result["runs"][3]["summary"]
    assert streamed["ttft_ms"]["p50"] > 0 and streamed["tpot_ms"]["p50"] > 0
    assert result["server"]["models"]["data"][0]["id"]


def test_offline_runs_the_same_presets_in_process(tmp_path, model_dir, capsys):
    out = tmp_path / "offline.json"
    assert main(["bench", "offline", model_dir, "--device", "cpu", "--preset", "sweep", "--concurrency", "1,3",
                 "--num-prompts", "3", "--input-len", "36", "--output-len", "3", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["kind"] == "offline" and [r["name"] for r in result["runs"]] == ["c=1", "c=3"]
    for run in result["runs"]:
        assert run["summary"]["completed"] == 3 and run["summary"]["total_output_tokens"] == 9
        assert run["summary"]["ttft_ms"]["p50"] > 0 and run["summary"]["itl_ms"]["p50"] > 0
        assert all(len(r["itl"]) == 2 for r in run["requests"])   # 3 tokens: 2 inter-token gaps each
        # each run's hit rate, from the engine's counters: every run has prompts of its own (36 tokens: two
        # cacheable blocks each, had a prompt been sent before)
        assert run["prefix_cache"]["source"] == "engine" and run["prefix_cache"]["queries"] == 3 * 36
        assert run["prefix_cache"]["hit_rate"] == 0.0
    starts = sorted(r["start"] for r in result["runs"][0]["requests"])
    assert starts[1] > 0   # c=1 is a closed loop: the second request waits for the first
    assert "c=3" in capsys.readouterr().out
