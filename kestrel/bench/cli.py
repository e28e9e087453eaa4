"""`kestrel bench serve | compare | offline`: parse flags, hand over to serve.py / report.py / offline.py.

Dataset and load flags are named as `vllm bench serve` names them; the older names stay as aliases.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import sys
from pathlib import Path

from kestrel.bench.datasets import DATASETS, DatasetConfig

# `kestrel launch --then` exports the server's URL here (launch.py run_then): a bench run inside it finds the
# server it launched without repeating --base-url.
BASE_URL_ENV = "KESTREL_BASE_URL"
DEFAULT_BASE_URL = "http://127.0.0.1:8000"
# HTTP client libraries that log every request at INFO: their lines would interleave with the progress line.
QUIET_LOGGERS = ("httpx", "httpcore", "aiohttp", "urllib3")


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers, e.g. 1,8,32,128") from None


def _add_dataset_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("dataset (vLLM's flag names; the older ones are aliases)")
    g.add_argument("--dataset-name", "--dataset", dest="dataset_name", default="random",
                   help=" | ".join(DATASETS) + " (default random)")
    g.add_argument("--dataset-path", help="sharegpt: a ShareGPT JSON / JSONL file; jsonl: one "
                                          "{\"prompt\": ..., \"output_len\": N} per line")
    g.add_argument("--tokenizer", help="tokenizer directory (or tokenizer.json) of the served model: exact-length "
                                       "random prompts; default: --model or the served model when it is a local "
                                       "checkpoint")
    g.add_argument("--random-input-len", "--input-len", dest="input_len", type=int, default=None,
                   help="prompt tokens (default 1024; 128 for single-and-peak)")
    g.add_argument("--random-output-len", "--output-len", dest="output_len", type=int, default=None,
                   help="max_tokens, with ignore_eos (default 128; 256 for single-and-peak)")
    g.add_argument("--random-range-ratio", "--range-ratio", dest="range_ratio", type=float, default=0.0,
                   help="lengths uniform in len*(1 +- ratio)")
    g.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    g.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    g.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    g.add_argument("--prefix-repetition-output-len", type=int, default=None, help="default --random-output-len")
    g.add_argument("--sharegpt-output-len", type=int, default=None, help="default: each conversation's reply")
    g.add_argument("--num-groups", type=int, default=8, help="shared-prefix: number of prefixes")
    g.add_argument("--prompts-per-group", type=int, default=16, help="shared-prefix")
    g.add_argument("--prefix-len", type=int, default=512, help="shared-prefix")
    g.add_argument("--suffix-len", type=int, default=64, help="shared-prefix")
    g.add_argument("--num-prompts", type=int, default=None)
    g.add_argument("--seed", type=int, default=0)


def add_parser(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmark an OpenAI-compatible server or the engine")
    sub = bench.add_subparsers(dest="bench_command", required=True)

    s = sub.add_parser("serve", help="load-test a running server (Kestrel, vLLM, SGLang, ...)")
    s.add_argument("--base-url", default=os.environ.get(BASE_URL_ENV, DEFAULT_BASE_URL),
                   help=f"default ${BASE_URL_ENV} (set by kestrel launch --then), else {DEFAULT_BASE_URL}")
    s.add_argument("--model", help="default: the first model of /v1/models")
    s.add_argument("--metrics-url", type=lambda t: tuple(u for u in t.split(",") if u), default=(),
                   help="comma-separated server URLs whose /metrics are added up for the prefix-cache and "
                   "speculation figures (the replicas behind a router: `kestrel launch --replicas` fills "
                   "{replica_urls} in --then); default: --base-url")
    s.add_argument("--endpoint", default="completions", help="completions | chat")
    s.add_argument("--preset", help="single-and-peak | sweep")
    _add_dataset_args(s)
    g = s.add_argument_group("load")
    g.add_argument("--max-concurrency", "--concurrency", dest="concurrency", type=_ints, default=(),
                   help="max requests in flight; a list (1,8,32) runs one run each")
    g.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (Poisson); default inf")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals (1 = Poisson)")
    g.add_argument("--duration", type=float, default=None, help="seconds: issue requests (cycled) this long")
    g.add_argument("--warmup-requests", type=int, default=1)
    g.add_argument("--no-stream", action="store_true", help="non-streaming requests (no TTFT/ITL)")
    g.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos/min_tokens")
    g.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    s.add_argument("--slo", help="goodput SLOs in ms, e.g. ttft:200,tpot:50 (keys ttft, tpot, e2e)")
    s.add_argument("--label", help="name of this system in reports (default: the model)")
    s.add_argument("--output", help="write the result JSON here")
    s.add_argument("--output-dir", help="write result.json (unless --output), comparison.md and PNG plots here")
    s.add_argument("--plot", action="store_true",
                   help="write comparison.md and the plots beside --output (or in the current directory)")
    s.add_argument("--no-progress", action="store_true")

    c = sub.add_parser("compare", help="markdown table and plots from result files")
    c.add_argument("results", nargs="+")
    c.add_argument("--labels", type=lambda t: t.split(","), help="comma-separated, one per file")
    c.add_argument("--output-dir", help="write comparison.md and PNG plots here")

    o = sub.add_parser("offline", help="measure the engine in-process (no HTTP)")
    o.add_argument("model", nargs="?", default=None, help="checkpoint directory (default: the embedded model)")
    o.add_argument("--device", default="auto")
    o.add_argument("--preset", help="single-and-peak | sweep")
    o.add_argument("--max-concurrency", "--concurrency", dest="concurrency", type=_ints, default=(),
                   help="batch sizes (requests given at once)")
    o.add_argument("--label")
    o.add_argument("--output")
    _add_dataset_args(o)


def run(args: argparse.Namespace) -> int:
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    if args.bench_command == "compare":
        return _compare(args)
    if args.bench_command == "offline":
        from kestrel.bench.offline import OfflineConfig, run_offline_benchmark

        cfg = OfflineConfig(model=args.model, device=args.device, preset=args.preset, concurrency=args.concurrency,
                            dataset=dataset_config(args), tokenizer=args.tokenizer, num_prompts=args.num_prompts,
                            seed=args.seed, label=args.label)
        result = run_offline_benchmark(cfg)
    else:
        from kestrel.bench.serve import ServeConfig, run_serve_benchmark

        cfg = ServeConfig(base_url=args.base_url, model=args.model, endpoint=args.endpoint, preset=args.preset,
                          dataset=dataset_config(args), tokenizer=args.tokenizer, num_prompts=args.num_prompts,
                          concurrency=args.concurrency, request_rate=args.request_rate,
                          burstiness=args.burstiness, duration_s=args.duration,
                          warmup_requests=args.warmup_requests, stream=not args.no_stream,
                          ignore_eos=not args.no_ignore_eos, slo=args.slo, seed=args.seed, label=args.label,
                          timeout_s=args.timeout, progress=not args.no_progress,
                          metrics_urls=args.metrics_url)
        result = run_serve_benchmark(cfg, on_run=_print_run, on_note=lambda text: print(f"note: {text}",
                                                                                         file=sys.stderr))
    from kestrel.bench.report import summary_table, write_report, write_result

    print(summary_table(result))
    output, out_dir = args.output, getattr(args, "output_dir", None)
    if out_dir and not output:
        output = str(Path(out_dir) / "result.json")
    if output:
        write_result(output, result)
        print(f"result written to {output}")
    if out_dir or getattr(args, "plot", False):
        for path in write_report([result], out_dir or str(Path(output or ".").parent)):
            print(f"wrote {path}")
    return 0 if all(r["summary"]["completed"] for r in result["runs"]) else 1


def dataset_config(args: argparse.Namespace) -> DatasetConfig:
    """The dataset flags (argparse dests) into a DatasetConfig: dest names are its field names."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(DatasetConfig)
              if f.name not in ("name", "path")}
    return DatasetConfig(name=args.dataset_name, path=args.dataset_path, **values)


def _print_run(run: dict) -> None:
    summary, cache = run["summary"], run.get("prefix_cache") or {}
    hit = f"{100 * cache['hit_rate']:.1f}%" if cache.get("hit_rate") is not None else "n/a"
    print(f"[{run['name']}] {summary['completed']} ok, {summary['failed']} failed, "
          f"{summary['total_input_tokens']} input / {summary['total_output_tokens']} output tokens, "
          f"{summary['output_throughput']:.1f} output tok/s, prefix cache hit {hit}", file=sys.stderr)


def _compare(args: argparse.Namespace) -> int:
    from kestrel.bench.report import compare_markdown, load_result, write_report

    results = [load_result(path) for path in args.results]
    print(compare_markdown(results, args.labels))
    if args.output_dir:
        for path in write_report(results, args.output_dir, args.labels):
            print(f"wrote {path}")
    return 0
