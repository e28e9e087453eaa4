"""Markdown from the GPU suite's JSON: one engine_bench.py report as full tables, or a whole suite run
(scripts/gpu_suite.sh) as one short table, with a baseline tree's figures and the change when it ran one.

    python -m benchmarks.report bench.json [--parity gpu_parity.json] [--append FILE.md --commit SHA]
    python -m benchmarks.report --suite OUT_DIR [--json summary.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path


def fmt(value, digits: int = 1) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def model_table(name: str, res: dict) -> list[str]:
    errors = {k: v for k, v in res.items() if k == "error" or k.endswith("_error")}
    if "kestrel" not in res:
        return [f"**{name}**: failed: " + "; ".join(f"{k} `{v}`" for k, v in errors.items()), ""]
    read = f", {res['decode_weight_bytes'] / 1e9:.2f} GB read per decode step" if "decode_weight_bytes" in res else ""
    lines = [f"**{name}** (weights {res['weight_bytes'] / 1e9:.2f} GB{read}, attention {res['attention_backend']}, "
             f"KV cache {res['kv_cache_tokens']:,} tokens)", "",
             "| variant | bs1 tok/s | bs1 ms/token | bs1 decode tok/s | 128 concurrent out tok/s |",
             "|---|---|---|---|---|"]
    for variant, v in res["kestrel"].items():
        if "error" in v:
            lines.append(f"| {variant} | error: `{v['error'][:80]}` | | | |")
            continue
        bs1, c = v.get("bs1", {}), v.get("c128", {})
        lines.append(f"| Kestrel {variant} | {fmt(bs1.get('tok_s'))} | {fmt(bs1.get('ms_per_token'), 2)} | "
                     f"{fmt(bs1.get('decode_tok_s'))} | {fmt(c.get('output_tok_s'), 0)} |")
    hf = res.get("hf_eager")
    if hf:
        lines.append(f"| HF transformers eager (same run) | {fmt(hf['bs1_tok_s'])} | {fmt(1000 / hf['bs1_tok_s'], 2)}"
                     f" | — | {fmt(hf['bs128_tok_s'], 0)} |")
    elif "hf_error" in res:
        lines.append(f"| HF transformers eager (same run) | error: `{res['hf_error'][:80]}` | | | |")
    lines.append(f"| roofline (weight bytes a step reads / copy bandwidth) | {fmt(res.get('roofline_bs1_tok_s'))} "
                 "| | | |")
    phases = ", ".join(f"{k} {v:.1f} s" for k, v in res.get("startup_phases_s", {}).items())
    sp = res.get("shared_prefix")
    if sp:
        lines += ["", f"Shared-prefix workload ({sp['workload']}):", "",
                  "| prefix cache | TTFT p50 ms | TTFT p90 ms | output tok/s | total tok/s | cached prompt tokens |",
                  "|---|---|---|---|---|---|"]
        for label in ("cache off", "cache on"):
            v = sp[label]
            lines.append(f"| {label} | {fmt(v['ttft_p50_ms'])} | {fmt(v['ttft_p90_ms'])} | {fmt(v['output_tok_s'], 0)} "
                         f"| {fmt(v['total_tok_s'], 0)} | {v['cached_prompt_tokens']:,} |")
    hit = res.get("ttft_128_prefix_cache_hit_rate")   # JSON before the fresh-prompt fix has none: said as unknown
    ttft_how = (f" (median of {res.get('ttft_runs', 5)} fresh prompts, prefix-cache hit rate {hit:.2f})"
                if hit is not None else " (prefix-cache hit rate not recorded)")
    graph_bs = res.get("cuda_graph_max_bs")
    graphs_at = f" (decode graphs to batch {graph_bs})" if graph_bs else ""
    lines += ["", f"TTFT one 128-token prompt: {fmt(res.get('ttft_128_ms'), 2)} ms{ttft_how}; startup to ready "
              f"{fmt(res.get('startup_s'))} s ({phases}); CUDA graph memory "
              f"{fmt(res.get('cuda_graph_memory_gib'), 2)} GiB{graphs_at}.", ""]
    return lines


def render(report: dict, parity: dict | None, commit: str | None) -> str:
    date = datetime.date.today().isoformat()
    lines = [f"### {date} · {report['gpu']} · commit {commit or '?'} · torch {report['torch']}", "",
             f"Copy bandwidth measured: {report['copy_bandwidth_tb_s']:.2f} TB/s (read + write).", ""]
    for name, res in report["models"].items():
        lines += model_table(name, res)
    if parity:
        lines += ["CUDA bf16 vs HF transformers fp32 (greedy, 5 prompts x 32 tokens): share of tokens identical "
                  "before the first divergence", "", "| model | variant | identical token share | identical sequences |",
                  "|---|---|---|---|"]
        for model, entry in parity.items():
            for variant, v in entry.items():
                if isinstance(v, dict):
                    lines.append(f"| {model} | {variant} | {v['identical_token_share']:.2f} | "
                                 f"{v['identical_sequences']}/5 |")
        lines.append("")
    return "\n".join(lines)


# The suite's rows, (label, value), from one tree's results.
def _bench_rows(model: str, res: dict) -> list[tuple[str, float | None]]:
    variants = res.get("kestrel") or {}
    main = next(iter(variants.values()), {})   # the first variant: the default backend with CUDA graphs
    return [(f"{model} bs1 tok/s", main.get("bs1", {}).get("tok_s")),
            (f"{model} 128 concurrent out tok/s", main.get("c128", {}).get("output_tok_s")),
            (f"{model} TTFT 128-token prompt ms", res.get("ttft_128_ms"))]


def _serve_rows(serve: dict) -> list[tuple[str, float | None]]:
    runs = {r["name"]: r["summary"] for r in serve.get("runs", [])}
    model = Path(str(serve.get("config", {}).get("model", "?"))).name
    ttft = (runs.get("single-stream", {}).get("ttft_ms") or {}).get("p50")
    return [(f"serve {model} bs1 tok/s", runs.get("single", {}).get("output_throughput")),
            (f"serve {model} 128 concurrent out tok/s", runs.get("peak", {}).get("output_throughput")),
            (f"serve {model} TTFT p50 ms (streamed)", ttft)]


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _tree_results(raw: Path, tree: str) -> tuple[dict, dict]:
    """bench_TREE_MODEL.json (engine_bench.py, one model each; not its per-system parts) and serve_TREE.json."""
    bench: dict = {}
    for f in sorted(raw.glob(f"bench_{tree}_*.json")):
        if f.name.endswith((".kestrel.json", ".hf.json")):
            continue
        data = _load(f) or {}
        bench.update({k: v for k, v in data.items() if k != "models"})
        bench.setdefault("models", {}).update(data.get("models", {}))
    return bench, _load(raw / f"serve_{tree}.json") or {}


def suite_summary(out_dir: Path) -> dict:
    """Every figure of a suite run: rows of (current, baseline, change %), the tests' outcome, the run's facts."""
    raw = out_dir / "raw" if (out_dir / "raw").is_dir() else out_dir
    meta = _load(out_dir / "suite.json") or {}
    cur_bench, cur_serve = _tree_results(raw, "cur")
    base_bench, base_serve = _tree_results(raw, "base")
    planned = meta.get("models", []) if "bench" in meta.get("stages", ["bench"]) else []
    models = list(dict.fromkeys([*planned, *cur_bench.get("models", {}), *base_bench.get("models", {})]))
    rows: list[dict] = []

    def add(cur: list, base: list) -> None:   # change: + is more tok/s, or more ms (rows ending in "ms")
        base_values = dict(base)
        for label, value in cur:
            b = base_values.get(label)
            change = 100 * (value - b) / b if value is not None and b else None
            rows.append({"row": label, "current": value, "baseline": b, "change_pct": change})

    for model in models:
        cur_res = cur_bench.get("models", {}).get(model, {})
        base_res = base_bench.get("models", {}).get(model, {})
        add(_bench_rows(model, cur_res), _bench_rows(model, base_res))
        for res, key in ((cur_res, "current"), (base_res, "baseline")):
            for k, v in res.items():
                if k == "error" or k.endswith("_error"):
                    rows.append({"row": f"{model} {k} ({key} tree)", "current": str(v)[:120], "baseline": None,
                                 "change_pct": None})
        hf = cur_res.get("hf_eager")
        if hf:
            rows.append({"row": f"{model} HF transformers eager bs1 / bs128 tok/s (same run)",
                         "current": f"{hf['bs1_tok_s']:,.1f} / {hf['bs128_tok_s']:,.0f}", "baseline": None,
                         "change_pct": None})
    if cur_serve or base_serve:
        add(_serve_rows(cur_serve), _serve_rows(base_serve))
    http = _load(raw / "http_overhead.json")
    if http and http.get("overhead_pct") is not None:
        rows.append({"row": f"HTTP overhead per token % ({Path(str(http.get('model'))).name}, "
                            f"{http.get('max_tokens')} tokens)", "current": http["overhead_pct"], "baseline": None,
                     "change_pct": None})
    for cold_file in sorted(raw.glob("cold_*.json")):   # benchmarks/cold_start.py, every compile cache empty
        cold = _load(cold_file) or {}
        name = Path(str(cold.get("model"))).name
        if cold.get("serve_args"):   # one of several COLD_VARIANTS
            name += f" ({' '.join(cold['serve_args'])})"
        if cold.get("ready_s") is not None:
            phases = ", ".join(f"{k} {v:.1f}" for k, v in cold.get("phases_s", {}).items())
            rows += [{"row": f"{name} cold start s (caches empty: {phases})", "current": cold["ready_s"],
                      "baseline": None, "change_pct": None},
                     {"row": f"{name} CUDA graph memory GiB", "current": cold.get("graph_memory_gib"),
                      "baseline": None, "change_pct": None},
                     {"row": f"{name} TTFT ms, fresh {cold.get('prompt_len')}-token prompt, streamed p50",
                      "current": cold.get("ttft_ms_p50"), "baseline": None, "change_pct": None}]
    for ttft_file in sorted(raw.glob("ttft_*.json")):   # benchmarks/ttft_breakdown.py
        ttft = _load(ttft_file) or {}
        name = Path(str(ttft.get("root") or ttft.get("model"))).name
        if ttft.get("server_ttft_ms_p50") is not None:
            stages = ", ".join(f"{k} {v:.2f}" for k, v in ttft.get("stages_ms_p50", {}).items())
            prompt = f"fresh {ttft.get('prompt_len')}-token prompt, streamed p50"
            rows += [{"row": f"{name} TTFT ms through kestrel serve, client ({prompt})",
                      "current": ttft.get("client_ttft_ms_p50"), "baseline": None, "change_pct": None},
                     {"row": f"{name} TTFT ms in the server by stage ({stages})",
                      "current": ttft["server_ttft_ms_p50"], "baseline": None, "change_pct": None}]
    tests = []
    tests_file = out_dir / "tests.tsv"
    if tests_file.is_file():
        for line in tests_file.read_text().splitlines():
            name, rc, *rest = line.split("\t") + [""]
            tests.append({"file": name, "exit": int(rc) if rc.lstrip("-").isdigit() else rc, "summary": rest[0]})
    return {**meta, "gpu": cur_bench.get("gpu") or meta.get("gpu"), "rows": rows, "tests": tests}


def suite_table(summary: dict) -> str:
    baseline = any(r.get("baseline") is not None for r in summary["rows"]) or summary.get("baseline_src")
    head = (f"GPU suite · {summary.get('gpu') or '?'} · commit {summary.get('commit') or '?'}"
            + (f" vs baseline {summary.get('baseline_commit') or summary.get('baseline_src') or '?'}" if baseline
               else "")
            + f" · {summary.get('date') or datetime.date.today().isoformat()}")
    lines = [head, ""]
    if baseline:
        lines += ["| row | current | baseline | change |", "|---|---:|---:|---:|"]
    else:
        lines += ["| row | value |", "|---|---:|"]
    for r in summary["rows"]:
        digits = 2 if " ms" in r["row"] else 0 if "concurrent" in r["row"] else 1
        cur = fmt(r["current"], digits)
        if baseline:
            change = "—" if r["change_pct"] is None else f"{r['change_pct']:+.1f}%"
            lines.append(f"| {r['row']} | {cur} | {fmt(r['baseline'], digits)} | {change} |")
        else:
            lines.append(f"| {r['row']} | {cur} |")
    tests = summary.get("tests") or []
    if tests:
        def name(t: dict) -> str:
            return t["file"].rsplit("/", 1)[-1]

        skipped = [name(t) for t in tests if t["exit"] == "skip"]
        failed = [name(t) + (" (timed out)" if t["exit"] in (124, 137) else "")
                  for t in tests if t["exit"] not in (0, 5, "skip")]
        cell = f"{len(tests) - len(failed) - len(skipped)}/{len(tests)} files passed"
        cell += f"; failed: {', '.join(failed)}" if failed else ""
        cell += f"; {len(skipped)} skipped (the suite's time budget was spent)" if skipped else ""
        lines.append(f"| tests/gpu | {cell} |" + (" | |" if baseline else ""))
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("bench_json", nargs="?")
    ap.add_argument("--parity", default=None)
    ap.add_argument("--append", default=None, help="append the table to this markdown file")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--suite", default=None, help="a gpu_suite.sh output folder: print its one short table")
    ap.add_argument("--json", default=None, help="with --suite: also write the table's figures here")
    args = ap.parse_args()
    if args.suite:
        summary = suite_summary(Path(args.suite))
        if args.json:
            Path(args.json).write_text(json.dumps(summary, indent=1))
        print(suite_table(summary))
        return 0
    if not args.bench_json:
        ap.error("a bench JSON file or --suite DIR is needed")
    path = Path(args.bench_json)
    if not path.is_file():
        print(f"no benchmark results at {path}")
        return 1
    report = json.loads(path.read_text())
    parity = None
    if args.parity and Path(args.parity).is_file():
        parity = json.loads(Path(args.parity).read_text())
    commit = args.commit
    if commit is None and (path.parent / "commit.txt").is_file():
        commit = (path.parent / "commit.txt").read_text().strip()
    text = render(report, parity, commit)
    print(text)
    if args.append:
        with open(args.append, "a") as f:
            f.write("\n" + text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
