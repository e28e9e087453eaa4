"""`kestrel bench serve` presets and `bench compare`, end to end against a real loopback server."""
from __future__ import annotations

import json

import pytest

from kestrel.bench.report import compare_markdown
from kestrel.cli import main
from tests.test_bench_fakeserver import FakeOpenAIServer

FAST = dict(ttft_s=0.02, gap_s=0.005)


def _serve(server, tmp_path, name, *flags):
    out = tmp_path / f"{name}.json"
    argv = ["bench", "serve", "--base-url", server.base_url, "--no-progress", "--warmup-requests", "0",
            "--label", name, "--output", str(out), *flags]
    assert main(argv) == 0
    return json.loads(out.read_text())


def test_single_and_peak_runs_the_tuning_report_method_then_streams_it(tmp_path, capsys):
    with FakeOpenAIServer(**FAST) as server:
        result = _serve(server, tmp_path, "kestrel", "--preset", "single-and-peak", "--output-len", "8",
                        "--num-prompts", "6", "--concurrency", "6")
        seen = server.requests_seen
    assert [r["name"] for r in result["runs"]] == ["single", "peak", "single-stream", "peak-stream"]
    assert [r["num_requests"] for r in result["runs"]] == [3, 6, 3, 6]
    assert [r["stream"] for r in result["runs"]] == [False, False, True, True]
    single, peak, single_stream, _ = result["runs"]
    assert single["summary"]["ttft_ms"]["p50"] is None and single_stream["summary"]["ttft_ms"]["p50"] > 0
    assert single["summary"]["per_request_tok_s"]["mean"] > 0 and peak["summary"]["output_throughput"] > 0
    assert all(r["output_tokens"] == 8 for run in result["runs"] for r in run["requests"])
    # the report method: full-length outputs, whatever the model would do at EOS
    assert all(body["ignore_eos"] and body["min_tokens"] == 8 for body in seen[1:])
    assert single["spec_decode"]["source"] == "kestrel"
    assert single["spec_decode"]["acceptance_rate"] == pytest.approx(0.5)
    assert single["spec_decode"]["mean_accepted_length"] == pytest.approx(2.5)
    assert single["spec_decode"]["acceptance_rate_per_pos"] == pytest.approx([0.8, 0.5, 0.2])
    assert result["server"]["model"] == "fake-model" and result["server"]["version"] == {"version": "fake-1.0"}
    assert result["environment"]["python"] and "packages" in result["environment"]
    out = capsys.readouterr().out
    assert "single-stream" in out   # the summary table
    assert ("[single] spec decode (kestrel): acceptance rate 0.5, acceptance length 2.5, "
            "per position 0.80 0.50 0.20") in out


def test_sweep_streams_each_concurrency_and_compare_renders_table_and_plots(tmp_path):
    with FakeOpenAIServer(**FAST) as server:
        a = _serve(server, tmp_path, "a", "--preset", "sweep", "--concurrency", "1,4", "--num-prompts", "4",
                   "--output-len", "4", "--input-len", "16", "--slo", "ttft:1000,tpot:1000")
    with FakeOpenAIServer(ttft_s=0.04, gap_s=0.005) as server:
        _serve(server, tmp_path, "b", "--preset", "sweep", "--concurrency", "1,4", "--num-prompts", "4",
               "--output-len", "4", "--input-len", "16", "--endpoint", "chat")
    assert [(r["name"], r["concurrency"], r["stream"]) for r in a["runs"]] == [("c=1", 1, True), ("c=4", 4, True)]
    assert a["runs"][1]["summary"]["goodput"] > 0
    out_dir = tmp_path / "report"
    assert main(["bench", "compare", str(tmp_path / "a.json"), str(tmp_path / "b.json"),
                 "--output-dir", str(out_dir)]) == 0
    table = (out_dir / "comparison.md").read_text()
    assert "| metric | a | b | b / a |" in table and "### c=4 (concurrency 4)" in table
    ttft_row = next(line for line in table.splitlines() if line.startswith("| TTFT ms p50"))
    ratio = float(ttft_row.split("|")[4].strip().rstrip("x"))
    assert 1.2 < ratio < 3.0     # b's first token comes 40 ms after the request, a's 20 ms
    for png in ("throughput_vs_concurrency.png", "ttft_cdf.png", "tpot_cdf.png"):
        assert (out_dir / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_request_rate_with_duration_jsonl_and_a_strict_server(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "one", "output_len": 3}\n{"prompt": "two"}\n')
    with FakeOpenAIServer(**FAST, reject_extra_params=True) as server:
        result = _serve(server, tmp_path, "strict", "--dataset", "jsonl", "--dataset-path", str(prompts),
                        "--output-len", "5", "--request-rate", "40", "--burstiness", "0.5", "--duration", "0.5")
        sent = server.requests_seen[-1]
    (run,) = result["runs"]
    assert run["name"] == "rate=40" and run["request_rate"] == 40
    assert 3 <= run["num_requests"] <= 60 and run["summary"]["failed"] == 0
    assert sorted({r["output_tokens"] for r in run["requests"]}) == [3, 5]
    # the server rejected ignore_eos and continuous usage: the bench dropped them and still counts tokens
    assert "ignore_eos" not in sent and sent["stream_options"] == {"include_usage": True}
    assert result["server"]["accepted_options"]["ignore_eos_min_tokens"] is False
    assert {r["token_source"] for r in run["requests"]} == {"usage"}


def test_shared_prefix_dataset_and_bad_flags(tmp_path, capsys):
    with FakeOpenAIServer(**FAST) as server:
        result = _serve(server, tmp_path, "sp", "--dataset", "shared-prefix", "--num-groups", "2",
                        "--prompts-per-group", "3", "--prefix-len", "20", "--suffix-len", "4", "--output-len", "2",
                        "--concurrency", "3")
        prompts = [body.get("prompt") for body in server.requests_seen[1:]]  # [0]: the probe
    assert result["runs"][0]["num_requests"] == 6
    assert len({" ".join(p.split()[:20]) for p in prompts}) == 2   # two shared prefixes, 3 prompts each
    assert len(set(prompts)) == 6
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--preset", "fast"]) == 2
    assert "--preset 'fast' is invalid" in capsys.readouterr().err
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--duration", "5"]) == 2
    assert "--duration 5.0 is invalid" in capsys.readouterr().err


def test_compare_markdown_puts_systems_in_columns_with_ratios():
    def result(tok_s):
        summary = {"output_throughput": tok_s, "failed": 0}
        return {"label": None, "runs": [{"name": "peak", "concurrency": 8, "summary": summary}]}

    table = compare_markdown([result(100.0), result(250.0)], labels=["vllm", "kestrel"])
    assert table.splitlines()[:4] == ["### peak (concurrency 8)",
                                      "| metric | vllm | kestrel | kestrel / vllm |",
                                      "|---|---:|---:|---:|",
                                      "| output tok/s | 100 | 250 | 2.50x |"]
