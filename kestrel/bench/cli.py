"""`kestrel bench serve | compare | offline`: parse flags, hand over to serve.py / report.py / offline.py."""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers, e.g. 1,8,32,128") from None


def _add_dataset_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("dataset")
    g.add_argument("--dataset", default="random", help="random | jsonl | shared-prefix | fixed (the 3 fixed prompts)")
    g.add_argument("--dataset-path", help="JSONL file: one {\"prompt\": ..., \"output_len\": N} per line")
    g.add_argument("--tokenizer", help="HF tokenizer directory (or tokenizer.json): random-token prompts and "
                                       "token counts when the server reports no usage")
    g.add_argument("--input-len", type=int, default=1024)
    g.add_argument("--output-len", type=int, default=None, help="default 128 (256 for single-and-peak)")
    g.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in len*(1 +- ratio)")
    g.add_argument("--num-prompts", type=int, default=None)
    g.add_argument("--num-groups", type=int, default=8, help="shared-prefix: number of prefixes")
    g.add_argument("--prompts-per-group", type=int, default=16)
    g.add_argument("--prefix-len", type=int, default=512)
    g.add_argument("--suffix-len", type=int, default=64)
    g.add_argument("--seed", type=int, default=0)


def add_parser(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmark an OpenAI-compatible server or the engine")
    sub = bench.add_subparsers(dest="bench_command", required=True)

    s = sub.add_parser("serve", help="load-test a running server (Kestrel, vLLM, SGLang, ...)")
    s.add_argument("--base-url", default="http://127.0.0.1:8000")
    s.add_argument("--model", help="default: the first model of /v1/models")
    s.add_argument("--endpoint", default="completions", help="completions | chat")
    s.add_argument("--preset", help="single-and-peak | sweep")
    _add_dataset_args(s)
    g = s.add_argument_group("load")
    g.add_argument("--concurrency", type=_ints, default=(), help="max requests in flight; a list runs a sweep")
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
    s.add_argument("--no-progress", action="store_true")

    c = sub.add_parser("compare", help="markdown table and plots from result files")
    c.add_argument("results", nargs="+")
    c.add_argument("--labels", type=lambda t: t.split(","), help="comma-separated, one per file")
    c.add_argument("--output-dir", help="write comparison.md and PNG plots here")

    o = sub.add_parser("offline", help="measure the engine in-process (no HTTP)")
    o.add_argument("model", nargs="?", default=None, help="checkpoint directory (default: the embedded model)")
    o.add_argument("--device", default="auto")
    o.add_argument("--preset", help="single-and-peak | sweep")
    o.add_argument("--concurrency", type=_ints, default=(), help="batch sizes (requests given at once)")
    o.add_argument("--label")
    o.add_argument("--output")
    _add_dataset_args(o)


def run(args: argparse.Namespace) -> int:
    if args.bench_command == "compare":
        return _compare(args)
    if args.bench_command == "offline":
        from kestrel.bench.offline import OfflineConfig, run_offline_benchmark

        cfg = OfflineConfig(model=args.model, device=args.device, preset=args.preset, concurrency=args.concurrency,
                            **_dataset_kwargs(args), label=args.label)
        result = run_offline_benchmark(cfg)
    else:
        from kestrel.bench.serve import ServeConfig, run_serve_benchmark

        cfg = ServeConfig(base_url=args.base_url, model=args.model, endpoint=args.endpoint, preset=args.preset,
                          **_dataset_kwargs(args), concurrency=args.concurrency, request_rate=args.request_rate,
                          burstiness=args.burstiness, duration_s=args.duration,
                          warmup_requests=args.warmup_requests, stream=not args.no_stream,
                          ignore_eos=not args.no_ignore_eos, slo=args.slo, label=args.label,
                          timeout_s=args.timeout, progress=not args.no_progress)
        result = run_serve_benchmark(cfg, on_run=lambda r: print(
            f"[{r['name']}] {r['summary']['completed']} ok, {r['summary']['failed']} failed, "
            f"{r['summary']['output_throughput']:.1f} output tok/s", file=sys.stderr))
    from kestrel.bench.report import summary_table, write_result

    print(summary_table(result))
    if args.output:
        write_result(args.output, result)
        print(f"result written to {args.output}")
    return 0 if all(r["summary"]["completed"] for r in result["runs"]) else 1


def _dataset_kwargs(args: argparse.Namespace) -> dict:
    names = ("dataset", "dataset_path", "tokenizer", "input_len", "output_len", "range_ratio", "num_prompts",
             "num_groups", "prompts_per_group", "prefix_len", "suffix_len", "seed")
    return {name: getattr(args, name) for name in names}


def _compare(args: argparse.Namespace) -> int:
    from kestrel.bench.report import compare_markdown, load_result, plot_comparison

    results = [load_result(path) for path in args.results]
    table = compare_markdown(results, args.labels)
    print(table)
    if args.output_dir:
        out = Path(args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "comparison.md").write_text(table)
        for path in plot_comparison(results, str(out), args.labels):
            print(f"wrote {path}")
    return 0
