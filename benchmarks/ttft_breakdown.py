"""Where the time to first token goes through `kestrel serve`: fresh prompts, streamed, one at a time, each
request's stages read from the server's kestrel:first_token_stage_seconds (kestrel/frontend/first_token.py) by
scraping /metrics before and after it, next to the TTFT the client saw.

    python -m benchmarks.ttft_breakdown [--model PATH] [--device cuda] [--out FILE] [-- extra kestrel serve flags]
    python -m benchmarks.ttft_breakdown --base-url http://127.0.0.1:8000      a server already running

Without --model it serves the default model (models/kestrel-tiny). Prompts are the bench's `random` dataset in
token ids of the served tokenizer (kestrel/bench/datasets.py): every one starts differently, so the prefix cache
has nothing to give, and a fresh seed each run keeps a reused server from having seen them. The JSON (default:
ttft-MODEL-DEVICE-DATE.json in the current directory) holds the median ms of each stage, of their sum (the server's
TTFT: ASGI app called to first chunk handed to the transport) and of the client's TTFT (request sent to first
chunk with text read); their difference is the connection and the client's own parsing.
"""
from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.cold_start import connect, kestrel_serve, split_serve_args, streamed_ttft
from kestrel.bench.datasets import DatasetConfig, build_requests
from kestrel.bench.tokenizer import load_tokenizer
from kestrel.frontend.first_token import STAGE_NAMES

STAGE_METRIC = "kestrel:first_token_stage_seconds"
RESULTS = Path(".")


def stage_totals(client: httpx.Client) -> dict[str, tuple[float, float]]:
    """stage -> (count, sum of seconds) from /metrics."""
    text = client.get("/metrics", timeout=10.0).text
    out: dict[str, list[float]] = {}
    for m in re.finditer(rf'^{re.escape(STAGE_METRIC)}_(count|sum)\{{[^}}]*stage="(\w+)"[^}}]*\}} (\S+)$', text,
                         re.MULTILINE):
        counts = out.setdefault(m.group(2), [0.0, 0.0])
        counts[0 if m.group(1) == "count" else 1] += float(m.group(3))
    return {name: (c, s) for name, (c, s) in out.items()}


def one_request(client: httpx.Client, conn: http.client.HTTPConnection, model: str, prompt: list[int],
                max_tokens: int) -> dict:
    """The client's TTFT (streamed on `conn`) and the server's stages of one request, ms."""
    before = stage_totals(client)
    client_s = streamed_ttft(conn, model, prompt, max_tokens)
    after = stage_totals(client)
    stages = {}
    for name in STAGE_NAMES:
        count = after.get(name, (0, 0))[0] - before.get(name, (0, 0))[0]
        if count != 1:
            raise RuntimeError(f"stage {name} was observed {count:g} times during one request: is another client "
                               "using this server, or is it not a Kestrel with first-token stages?")
        stages[name] = 1000 * (after[name][1] - before[name][1])
    return {"client_ttft_ms": 1000 * client_s, "server_ttft_ms": sum(stages.values()), "stages_ms": stages}


def measure(base: str, prompt_len: int, requests: int, warmup: int, max_tokens: int, seed: int) -> dict:
    with httpx.Client(base_url=base) as client, contextlib.closing(connect(base)) as conn:
        card = client.get("/v1/models", timeout=10.0).json()["data"][0]
        tokenizer = load_tokenizer(card.get("root"), (card["id"],))
        prompts = [r.prompt for r in build_requests(DatasetConfig("random"), warmup + requests, prompt_len,
                                                    max_tokens, tokenizer, seed, token_prompts=True)]
        if not all(isinstance(p, list) for p in prompts):   # no tokenizer found: word prompts would not be exact
            raise RuntimeError(f"no tokenizer.json under the served model's root {card.get('root')!r}")
        for prompt in prompts[:warmup]:
            streamed_ttft(conn, card["id"], prompt, max_tokens)
        runs = [one_request(client, conn, card["id"], prompt, max_tokens) for prompt in prompts[warmup:]]

    def median(values: list[float]) -> float:
        return round(statistics.median(values), 3)

    return {"model": card["id"], "root": card.get("root"), "prompt_len": prompt_len, "max_tokens": max_tokens,
            "requests": requests, "warmup": warmup, "seed": seed,
            "client_ttft_ms_p50": median([r["client_ttft_ms"] for r in runs]),
            "server_ttft_ms_p50": median([r["server_ttft_ms"] for r in runs]),
            "outside_server_ms_p50": median([r["client_ttft_ms"] - r["server_ttft_ms"] for r in runs]),
            "stages_ms_p50": {name: median([r["stages_ms"][name] for r in runs]) for name in STAGE_NAMES},
            "runs": [{"client_ttft_ms": round(r["client_ttft_ms"], 3), "server_ttft_ms": round(r["server_ttft_ms"], 3),
                      "stages_ms": {k: round(v, 4) for k, v in r["stages_ms"].items()}} for r in runs]}


def table(result: dict) -> str:
    lines = [f"TTFT by stage, ms (median of {result['requests']} fresh {result['prompt_len']}-token prompts, "
             f"streamed; {Path(str(result['model'])).name})"]
    for name, ms in result["stages_ms_p50"].items():
        lines.append(f"  {name:<15} {ms:9.3f}")
    lines.append(f"  {'server TTFT':<15} {result['server_ttft_ms_p50']:9.3f}   (sum of the stages, per request)")
    lines.append(f"  {'client TTFT':<15} {result['client_ttft_ms_p50']:9.3f}   "
                 f"(outside the server: {result['outside_server_ms_p50']:.3f})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv, serve_args = split_serve_args(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="checkpoint to serve (default: the default model, models/kestrel-tiny)")
    ap.add_argument("--base-url", help="measure this running server instead of starting one")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--port", type=int, default=8019)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--requests", type=int, default=10, help="timed requests (their median); at least 5")
    ap.add_argument("--warmup", type=int, default=3, help="untimed requests first")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--seed", type=int, default=None, help="prompt seed (default: a fresh one each run)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for a started server")
    ap.add_argument("--out", help="result JSON (default: ttft-MODEL-DEVICE-DATE.json in the current directory)")
    args = ap.parse_args(argv)
    if args.requests < 5:
        ap.error(f"--requests {args.requests} is too few: a median needs at least 5")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)

    def run(base: str) -> dict:
        return measure(base, args.prompt_len, args.requests, args.warmup, args.max_tokens, seed)

    if args.base_url:
        result = run(args.base_url.rstrip("/"))
    else:
        from kestrel.config import DEFAULT_MODEL_DIR

        model = args.model or str(DEFAULT_MODEL_DIR)
        with tempfile.TemporaryDirectory(prefix="kestrel-ttft-") as root:
            log_path = Path(root) / "server.log"
            try:
                with kestrel_serve(model, args.device, args.port, serve_args, log_path, args.timeout) as (base, _):
                    result = run(base)
            except BaseException:
                sys.stderr.write(log_path.read_text()[-4000:])
                raise
        result["device"] = args.device
    result["date"] = time.strftime("%Y-%m-%d")
    name = f"ttft-{Path(str(result['model'])).name}-{result.get('device', 'server')}-{result['date']}.json"
    out = Path(args.out) if args.out else RESULTS / name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(table(result))
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
