"""Cold start and first-request latency of `kestrel serve`, as a new user meets them.

Every compile cache Kestrel's stack writes (Triton, TorchInductor, the CUDA driver's JIT cache, FlashInfer's and
torch extensions' builds under XDG_CACHE_HOME) is pointed at a fresh empty directory, so nothing compiled by an
earlier run is reused, then the server is started and timed:

    ready_s       from starting the process to /health answering 200
    phases        seconds per startup phase, as the server's /health reports them ("starting" is everything
                  before the model is resolved: the interpreter, imports, the HTTP server)
    graph memory  the server log's "graphs hold X GiB" line (the allocator's counters before and after capture),
                  with the capture size it was measured at (cuda_graph_max_bs: the largest decode graph's batch;
                  the default server's is 256)
    TTFT          streamed /v1/completions with fresh prompts of --prompt-len random token ids (none in the
                  prefix cache), median of --requests; prefix_cache_hit_rate: the timed requests' (/metrics)

    python -m benchmarks.cold_start MODEL [--device cuda] [--out cold.json] [-- extra kestrel serve flags]
"""
from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import httpx

CACHE_VARIABLES = ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "CUDA_CACHE_PATH", "XDG_CACHE_HOME",
                   "TORCH_EXTENSIONS_DIR", "FLASHINFER_WORKSPACE_BASE")


def cold_environment(root: Path) -> dict[str, str]:
    """This process's environment with every compile cache in a fresh directory under root."""
    env = dict(os.environ)
    for name in CACHE_VARIABLES:
        path = root / name.lower()
        path.mkdir(parents=True, exist_ok=True)
        env[name] = str(path)
    return env


def wait_ready(base: str, proc: subprocess.Popen, timeout_s: float) -> dict:
    """Poll /health until 200; returns its last body with ready_s (from the process's start) added."""
    start = time.monotonic()
    body: dict = {}
    while time.monotonic() - start < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode} before it was ready")
        try:
            r = httpx.get(f"{base}/health", timeout=2.0)
            body = r.json()
            if r.status_code == 200:
                return dict(body, ready_s=time.monotonic() - start)
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.05)
    raise TimeoutError(f"not ready after {timeout_s:.0f} s (last /health: {body})")


def streamed_ttft(conn: http.client.HTTPConnection, model: str, prompt: list[int], max_tokens: int) -> float:
    """Seconds from sending the request to the first streamed chunk that carries text (or the finish: random
    weights can draw only tokens that decode to nothing); the stream is read to its end, so the request is over
    when this returns. One kept connection for every request, as a real client keeps its pool, and the standard
    library's client: a new httpx.Client costs 30-60 ms (its SSL context) and httpx's parsing ~0.6 ms more than
    http.client's per streamed request, both of which would count as the server's TTFT."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                       "ignore_eos": True, "temperature": 0}).encode()
    ttft = None
    start = time.perf_counter()
    conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {r.read()[:500]!r}")
    while line := r.readline():
        if ttft is None and line.startswith(b"data: {"):
            choice = (json.loads(line[6:])["choices"] or [{}])[0]
            if choice.get("text") or choice.get("finish_reason"):
                ttft = time.perf_counter() - start
    if ttft is None:
        raise RuntimeError("the stream ended without a token")
    return ttft


def connect(base: str) -> http.client.HTTPConnection:
    """A kept connection to http://host:port for streamed_ttft."""
    url = urllib.parse.urlsplit(base)
    return http.client.HTTPConnection(url.hostname, url.port or 80, timeout=120.0)


def graph_memory_gib(log: str) -> float | None:
    found = re.findall(r"graphs hold ([0-9.]+) GiB", log)
    return float(found[-1]) if found else None


def graph_memory_device_gib(log: str) -> float | None:
    """The capture line's device-wide figure (the allocator's plus what CUDA itself took)."""
    found = re.findall(r"graphs hold [0-9.]+ GiB \(allocator; ([0-9.]+) GiB device-wide\)", log)
    return float(found[-1]) if found else None


def graph_max_bs(log: str) -> int | None:
    """The largest decode batch the server captured a graph for (the size graph_memory_gib was measured at):
    from its "captured N decode graphs (batch sizes [...])" line."""
    found = re.findall(r"captured \d+ decode graphs \(batch sizes \[([0-9, ]*)\]\)", log)
    sizes = [int(x) for x in found[-1].split(",") if x.strip()] if found else []
    return max(sizes) if sizes else None


@contextlib.contextmanager
def kestrel_serve(model: str, device: str, port: int, serve_args: list[str], log_path: Path, timeout_s: float,
                  env: dict[str, str] | None = None) -> Iterator[tuple[str, dict]]:
    """`kestrel serve MODEL` in a child process, its output in log_path: (base URL, /health once ready); the
    server is stopped (terminated, then killed) on the way out."""
    cmd = [sys.executable, "-m", "kestrel.cli", "serve", model, "--device", device, "--port", str(port), *serve_args]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        yield base, wait_ready(base, proc, timeout_s)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def measure(model: str, device: str, port: int, prompt_len: int, requests: int, serve_args: list[str],
            timeout_s: float) -> dict:
    # here, not at the top: startup_profile.py imports this module before it points the compile caches at fresh
    # directories, and nothing may import torch before that
    from kestrel.bench.fresh import FreshPrompts
    from kestrel.bench.server_info import prefix_cache_stats, scrape_metrics

    with tempfile.TemporaryDirectory(prefix="kestrel-cold-") as root:
        log_path = Path(root) / "server.log"
        with kestrel_serve(model, device, port, serve_args, log_path, timeout_s,
                           env=cold_environment(Path(root))) as (base, health):
            card = httpx.get(f"{base}/v1/models", timeout=5.0).json()["data"][0]
            # random ids well inside any vocabulary, each prompt with a first token of its own: none shares a
            # prefix with another (the warm-up's included), so every timed TTFT is a prefill, not a cache hit
            fresh = FreshPrompts(1000, seed=0, low=10)
            conn = connect(base)
            try:
                streamed_ttft(conn, card["id"], fresh.one(prompt_len), 2)   # warm-up
                before = scrape_metrics(base)
                ttfts = [streamed_ttft(conn, card["id"], fresh.one(prompt_len), 2) for _ in range(requests)]
                after = scrape_metrics(base)
            finally:
                conn.close()
            cache = prefix_cache_stats(before, after)
        log_text = log_path.read_text()
    phases = health.get("phases", {})
    return {"model": model, "device": device, "ready_s": round(health["ready_s"], 3), "phases_s": phases,
            "unaccounted_s": round(health["ready_s"] - sum(phases.values()), 3),
            "graph_memory_gib": graph_memory_gib(log_text),
            "graph_memory_device_gib": graph_memory_device_gib(log_text),
            "cuda_graph_max_bs": graph_max_bs(log_text),   # the capture size the graph memory was measured at
            "prompt_len": prompt_len,
            "ttft_ms_p50": round(1000 * statistics.median(ttfts), 2),
            # the timed requests' (the server's /metrics before and after them), as `kestrel bench serve` reports
            "prefix_cache_hit_rate": cache["hit_rate"] if cache else None, "prefix_cache": cache,
            "ttft_ms": [round(1000 * t, 2) for t in ttfts], "caches": "fresh (" + ", ".join(CACHE_VARIABLES) + ")",
            # the startup's own account (phases, compile workers, graphs, errors), to read a figure by
            "server_log": [line for line in log_text.splitlines()
                           if re.search(r"phase:|compile worker|captured|rror|Traceback", line)][:80]}


def split_serve_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """(this script's arguments, the `kestrel serve` flags after a `--`)."""
    if "--" not in argv:
        return argv, []
    at = argv.index("--")
    return argv[:at], argv[at + 1:]


def main(argv: list[str] | None = None) -> int:
    argv, serve_args = split_serve_args(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--port", type=int, default=8017)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--requests", type=int, default=5, help="fresh prompts timed for TTFT (their median)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the server to be ready")
    ap.add_argument("--out", help="write the result JSON here")
    args = ap.parse_args(argv)
    result = measure(args.model, args.device, args.port, args.prompt_len, args.requests, serve_args, args.timeout)
    result["date"] = time.strftime("%Y-%m-%d")
    result["serve_args"] = serve_args
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    phases = ", ".join(f"{k} {v:.1f}" for k, v in result["phases_s"].items())
    print(f"cold start {result['ready_s']:.1f} s ({phases}); graphs {result['graph_memory_gib']} GiB; "
          f"TTFT p50 {result['ttft_ms_p50']:.1f} ms ({args.prompt_len}-token fresh prompts)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
