"""The GPU suite's one short table (lab/scripts/gpu_suite.sh prints it last): every figure of a suite run's output
folder, with a baseline tree's figures and the change when it ran one.

    python -m lab.suite_table OUT_DIR [--json summary.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

from benchmarks.report import fmt


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
    ap.add_argument("out_dir", help="a gpu_suite.sh output folder")
    ap.add_argument("--json", default=None, help="also write the table's figures here")
    args = ap.parse_args()
    summary = suite_summary(Path(args.out_dir))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    print(suite_table(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
