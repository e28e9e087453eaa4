"""`kestrel bench serve` against a real Kestrel server (uvicorn on loopback, the embedded default model, CPU):
what it sends is what it says, the report carries token counts and the prefix-cache hit rate, and its errors and
progress output are readable.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from kestrel.cli import main
from kestrel.config import DEFAULT_MODEL_DIR, EngineConfig
from tests.test_server import LiveServer


@pytest.fixture(scope="module")
def server():
    with LiveServer(EngineConfig(model=str(DEFAULT_MODEL_DIR), device="cpu")) as s:
        yield s


def _bench(server, tmp_path, name: str, *flags: str) -> dict:
    out = tmp_path / f"{name}.json"
    assert main(["bench", "serve", "--base-url", server.url, "--no-progress", "--output", str(out), *flags]) == 0
    return json.loads(out.read_text())


def test_random_prompts_reach_the_server_at_exactly_the_stated_length_and_miss_the_cache(server, tmp_path):
    # no --tokenizer: the bench finds the embedded model's tokenizer from the served model's name
    result = _bench(server, tmp_path, "random", "--dataset-name", "random", "--random-input-len", "40",
                    "--random-output-len", "4", "--num-prompts", "8", "--max-concurrency", "4")
    (run,) = result["runs"]
    assert result["config"]["tokenizer"].endswith("tokenizer.json")
    assert run["summary"]["failed"] == 0
    # the server's own usage counts: 40 prompt tokens and 4 generated for every request
    assert [(r["prompt_tokens"], r["output_tokens"]) for r in run["requests"]] == [(40, 4)] * 8
    assert run["summary"]["total_input_tokens"] == 320 and run["summary"]["total_output_tokens"] == 32
    cache = run["prefix_cache"]
    assert cache["source"] == "kestrel" and cache["queries"] >= 320
    assert cache["hit_rate"] < 0.05                       # distinct prompts: nothing to reuse
    assert run["summary"]["total_cached_tokens"] == 0


def test_prefix_repetition_reports_the_cache_hits_it_causes(server, tmp_path, capsys):
    result = _bench(server, tmp_path, "prefix", "--dataset-name", "prefix-repetition",
                    "--prefix-repetition-prefix-len", "64", "--prefix-repetition-suffix-len", "8",
                    "--prefix-repetition-num-prefixes", "2", "--prefix-repetition-output-len", "2",
                    "--num-prompts", "8", "--max-concurrency", "2")
    (run,) = result["runs"]
    assert [r["prompt_tokens"] for r in run["requests"]] == [72] * 8
    # 2 prefixes of 64 tokens shared by 4 prompts each: at least the last 2 of each group find 3 full blocks
    assert run["prefix_cache"]["hit_rate"] > 0.3
    assert run["summary"]["total_cached_tokens"] > 0
    out = capsys.readouterr()
    assert "cache hit" in out.out and "prefix cache hit" in out.err


def test_output_dir_writes_the_result_the_table_and_the_plots(server, tmp_path):
    out_dir = tmp_path / "report"
    assert main(["bench", "serve", "--base-url", server.url, "--no-progress", "--preset", "sweep",
                 "--max-concurrency", "1,2", "--num-prompts", "2", "--random-input-len", "16",
                 "--random-output-len", "3", "--output-dir", str(out_dir)]) == 0
    result = json.loads((out_dir / "result.json").read_text())
    assert [r["name"] for r in result["runs"]] == ["c=1", "c=2"]
    table = (out_dir / "comparison.md").read_text()
    assert "### c=2 (concurrency 2)" in table and "| prefix cache hit rate |" in table
    for png in ("throughput_vs_concurrency.png", "ttft_cdf.png", "tpot_cdf.png"):
        assert (out_dir / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_no_server_gives_one_clear_connection_error(capsys):
    with socket.socket() as s:   # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    assert main(["bench", "serve", "--base-url", url]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: connection refused to {url}"), err
    assert "--model" not in err[0]


def test_progress_of_a_concurrent_run_has_no_http_log_lines_and_uses_the_launch_url(server, tmp_path):
    # a child process, as `kestrel launch --then` runs it: $KESTREL_BASE_URL instead of --base-url, INFO logging
    env = dict(os.environ, KESTREL_BASE_URL=server.url, PYTHONPATH=os.getcwd())
    proc = subprocess.run([sys.executable, "-m", "kestrel.cli", "bench", "serve", "--max-concurrency", "3",
                           "--num-prompts", "6", "--random-input-len", "16", "--random-output-len", "3"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "httpx" not in proc.stderr and "HTTP Request" not in proc.stderr, proc.stderr
    assert "[c=3] 6/6 finished, 18/18 tokens, elapsed " in proc.stderr   # 3 tokens each, streamed
    assert "c=3" in proc.stdout and "cache hit" in proc.stdout


def test_against_a_gguf_model_the_bench_finds_its_tokenizer_in_the_gguf(tmp_path):
    """`kestrel serve m.gguf` reports the .gguf as its root: the bench rebuilds the tokenizer from the file's
    vocabulary (as the server does), so random prompts have exactly the stated length."""
    from tests.gguf_files import write_llama_gguf

    path = tmp_path / "m.gguf"
    write_llama_gguf(path)
    with LiveServer(EngineConfig(model=str(path), device="cpu")) as gguf_server:
        result = _bench(gguf_server, tmp_path, "gguf", "--random-input-len", "16", "--random-output-len", "2",
                        "--num-prompts", "4", "--max-concurrency", "2")
    assert result["config"]["tokenizer"] == str(path)
    (run,) = result["runs"]
    assert [(r["prompt_tokens"], r["output_tokens"]) for r in run["requests"]] == [(16, 2)] * 4
