"""Single-stream cost of the HTTP layer: ms per output token through `kestrel serve` vs `LLM.generate` in-process.

The same greedy request (ignore_eos, fixed length) runs both ways; decode ms/token is measured from the first to
the last token so prefill does not blur it. The in-process engine is released before the server starts, so both
get the whole device. Prints one JSON object.

    python benchmarks/http_overhead.py --model models/kestrel-tiny --max-tokens 256 --repeats 5
"""
from __future__ import annotations

import argparse
import gc
import json
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))   # run as a plain script from a checkout


def in_process(args) -> dict:
    import torch

    from kestrel import LLM, SamplingParams

    llm = LLM(model=args.model, device=args.device)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate([args.prompt], params)   # warm-up
    runs = []
    for _ in range(args.repeats):
        first: list[float] = []
        start = time.perf_counter()
        out = llm.generate([args.prompt], params,
                           on_text=lambda *_: first.append(time.perf_counter()) if not first else None)
        end = time.perf_counter()
        runs.append(_timing(start, first[0] if first else end, end, len(out[0].outputs[0].token_ids)))
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return _summary(runs)


def over_http(args) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "kestrel.cli", "serve", "--port", str(port), "--device", args.device,
           "--log-level", "warning"] + (["--model", args.model] if args.model else []) + args.serve_arg
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_ready(url, proc)
        body = {"prompt": args.prompt, "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        with httpx.Client(base_url=url, timeout=600) as client:
            _stream(client, body)   # warm-up
            runs = [_stream(client, body) for _ in range(args.repeats)]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return _summary(runs)


def _stream(client: httpx.Client, body: dict) -> dict:
    start = time.perf_counter()
    first = last = None
    tokens = 0
    with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices"):
                last = time.perf_counter()
                first = first or last
    return _timing(start, first or last, last, tokens)


def _wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kestrel serve exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError("server not ready")


def _timing(start: float, first: float, end: float, tokens: int) -> dict:
    return {"ttft_ms": (first - start) * 1e3, "ms_per_token": (end - first) * 1e3 / max(tokens - 1, 1),
            "tokens": tokens}


def _summary(runs: list[dict]) -> dict:
    return {"ttft_ms": statistics.median(r["ttft_ms"] for r in runs),
            "ms_per_token": statistics.median(r["ms_per_token"] for r in runs),
            "tokens": runs[-1]["tokens"], "runs": len(runs)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint directory (default: embedded kestrel-tiny)")
    p.add_argument("--device", default="auto")
    p.add_argument("--prompt", default="The quick brown fox")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--serve-arg", action="append", default=[],
                   help="extra flag for `kestrel serve`, repeatable (e.g. --serve-arg=--engine-in-thread)")
    args = p.parse_args()
    local = in_process(args)
    http = over_http(args)
    overhead = http["ms_per_token"] - local["ms_per_token"]
    print(json.dumps({"model": args.model or "kestrel-tiny", "device": args.device, "max_tokens": args.max_tokens,
                      "serve_args": args.serve_arg,
                      "in_process": local, "http": http, "overhead_ms_per_token": overhead,
                      "overhead_pct": 100 * overhead / local["ms_per_token"] if local["ms_per_token"] else None},
                     indent=2))


if __name__ == "__main__":
    main()
