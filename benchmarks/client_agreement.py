"""`kestrel bench serve` against an independent, well-known client on the same server and workload: GuideLLM
(vllm-project/guidellm, `pip install guidellm`), runs alternating so that drift hits both alike. On a machine
without network, download its wheels elsewhere (GuideLLM 0.8.1 and what the machine lacks: `pip download
--no-deps`) and install them with `--no-deps --target`.

    python -m benchmarks.client_agreement --base-url http://127.0.0.1:8000 --guidellm /path/to/guidellm \\
        --tokenizer MODEL_DIR [--concurrency 1,4] [--input-len 128] [--output-len 128] [--num-prompts 16] \\
        [--rounds 2] --out agreement.json

Compared per concurrency (medians over the rounds): TTFT p50, TPOT and output tok/s. The metric names differ
(docs/bench.md): GuideLLM's `time_per_output_token_ms` divides the whole request latency (TTFT included) by the
output tokens, while its `inter_token_latency_ms` is (latency - TTFT) / (output tokens - 1), which is vLLM's and
Kestrel's TPOT, so Kestrel's TPOT is set against GuideLLM's inter-token latency, mean against mean (GuideLLM's
percentiles are over tokens, Kestrel's over requests). Both send 128-token prompts of random content with
max_tokens = output length and ignore_eos, streamed, to /v1/completions.
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run_client(cmd: list[str], timeout: float) -> None:
    """Run one client; where it fails, stop with its own last words (its output is captured to keep the log short)."""
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0:
        tail = "\n".join((res.stderr or res.stdout).strip().splitlines()[-25:])
        sys.exit(f"{shlex.join(cmd[:4])} ... exited {res.returncode}:\n{tail}")


def kestrel_run(base_url: str, concurrency: int, args: argparse.Namespace, out: Path) -> dict:
    run_client([sys.executable, "-m", "kestrel.cli", "bench", "serve", "--base-url", base_url,
               "--dataset-name", "random", "--random-input-len", str(args.input_len),
               "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
               "--max-concurrency", str(concurrency), "--seed", str(int(time.time())), "--no-progress",
               "--output", str(out)], args.timeout)
    s = json.loads(out.read_text())["runs"][0]["summary"]
    return {"ttft_p50_ms": s["ttft_ms"]["p50"], "tpot_mean_ms": s["tpot_ms"]["mean"],
            "output_tok_s": s["output_throughput"], "requests": s["completed"],
            "output_tokens": s["total_output_tokens"], "input_tokens": s["total_input_tokens"]}


def guidellm_run(base_url: str, model: str, concurrency: int, args: argparse.Namespace, out: Path) -> dict:
    profile = "kind=synchronous" if concurrency == 1 else f"kind=concurrent,streams={concurrency}"
    run_client([*shlex.split(args.guidellm), "run",
               "--backend", f"kind=openai_http,target={base_url},model={model},request_format=/v1/completions",
               "--profile", profile,
               "--data", f"kind=synthetic_text,prompt_tokens={args.input_len},output_tokens={args.output_len}",
               "--constraint", f"kind=max_requests,count={args.num_prompts}",
               "--tokenizer", f"kind=huggingface_auto,model={args.tokenizer}",
               "--output", f"kind=json,path={out}", "--disable-console"], args.timeout)
    m = json.loads(out.read_text())["benchmarks"][0]["metrics"]
    ok = lambda name: m[name]["successful"]   # noqa: E731 - successful requests' distribution of one metric
    return {"ttft_p50_ms": ok("time_to_first_token_ms")["median"], "tpot_mean_ms": ok("inter_token_latency_ms")["mean"],
            "output_tok_s": ok("output_tokens_per_second")["mean"], "requests": ok("output_token_count")["count"],
            "output_tokens": round(ok("output_token_count")["mean"] * ok("output_token_count")["count"]),
            "input_tokens": round(ok("prompt_token_count")["mean"] * ok("prompt_token_count")["count"])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--guidellm", required=True,
                    help="the guidellm command, e.g. `guidellm` or `python3 -m guidellm`")
    ap.add_argument("--tokenizer", required=True, help="the served model's tokenizer directory (for GuideLLM)")
    ap.add_argument("--model", default=None, help="default: the first model of /v1/models")
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    import httpx
    model = args.model or httpx.get(f"{args.base_url}/v1/models", timeout=10).json()["data"][0]["id"]
    report: dict = {"base_url": args.base_url, "model": model, "input_len": args.input_len,
                    "output_len": args.output_len, "num_prompts": args.num_prompts, "rounds": args.rounds,
                    "date": time.strftime("%Y-%m-%d"), "runs": [], "agreement": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for c in [int(x) for x in args.concurrency.split(",")]:
            per_tool: dict[str, list[dict]] = {"kestrel": [], "guidellm": []}
            for r in range(args.rounds):
                order = ("kestrel", "guidellm") if r % 2 == 0 else ("guidellm", "kestrel")
                for tool in order:
                    out = Path(tmp) / f"{tool}-{c}-{r}.json"
                    print(f"[agreement] concurrency {c}, round {r + 1}/{args.rounds}: {tool}", file=sys.stderr)
                    row = kestrel_run(args.base_url, c, args, out) if tool == "kestrel" else \
                        guidellm_run(args.base_url, model, c, args, out)
                    per_tool[tool].append(row)
                    report["runs"].append({"tool": tool, "concurrency": c, "round": r, **row})
            medians = {tool: {k: statistics.median(run[k] for run in runs) for k in runs[0]}
                       for tool, runs in per_tool.items()}
            report["agreement"][str(c)] = {
                **medians, "kestrel_over_guidellm": {k: round(medians["kestrel"][k] / medians["guidellm"][k], 3)
                                                     for k in ("ttft_p50_ms", "tpot_mean_ms", "output_tok_s")}}
            print(f"[agreement] concurrency {c}: kestrel/guidellm "
                  f"{report['agreement'][str(c)]['kestrel_over_guidellm']}", file=sys.stderr)
    args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
