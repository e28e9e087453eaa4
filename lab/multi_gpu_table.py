"""The short table of lab/scripts/multi_gpu_suite.sh, from the files its steps wrote into one folder:

    ar_tp{N}.json          benchmarks/all_reduce_bench.py at N ranks
    bench_tp{N}.json       benchmarks/engine_bench.py --tensor-parallel-size N (the symmetric road on)
    bench_tp{N}_nccl.json  the same with --disable-custom-all-reduce
    sigterm.json           benchmarks/sigterm_check.py
    tests.log              pytest tests/gpu/test_tp_gpu.py

    python -m lab.multi_gpu_table DIR [--model llama-3.1-8b] [--json summary.json]

Prints the all-reduce times per message size, then one row per engine run (bs1 decode, its speedup over TP=1,
128 concurrent, TTFT, startup, the 8B step's all-reduce time by road) and the issue's targets, met or not. A step
that failed or did not run shows as such; nothing here raises on a missing or partial file.
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

# Issue #37: bs1 decode of the 8B shape at TP=N against TP=1
SPEEDUP_TARGETS = {2: 1.5, 4: 2.2}


def load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def fmt(x, digits: int = 1) -> str:
    return "—" if x is None else f"{x:,.{digits}f}"


def last_line(path: Path) -> str | None:
    """A step's log's last line but the suite's rc=N: a traceback's error, or why the step was skipped."""
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip() and not ln.startswith("rc=")]
    except OSError:
        return None
    return lines[-1].strip()[:160] if lines else None


def engine_row(report: dict | None, model: str, log: Path | None = None) -> dict:
    """The figures of one engine_bench report: its default road's bs1 and 128-concurrent runs."""
    if report is None:
        why = last_line(log) if log else None
        return {"error": f"no report (the run did not finish{': ' + why if why else ''})"}
    res = report.get("models", {}).get(model, {})
    error = res.get("kestrel_error") or res.get("error")
    variants = res.get("kestrel") or {}
    name = next((k for k in variants if k.endswith("+graphs")), next(iter(variants), None))
    main = variants.get(name, {}) if name else {}
    row = {"tp": res.get("tensor_parallel_size", report.get("tensor_parallel_size", 1)),
           "disable_custom_all_reduce": res.get("disable_custom_all_reduce", report.get("disable_custom_all_reduce")),
           "custom_all_reduce": res.get("custom_all_reduce"), "variant": name,
           "bs1_tok_s": main.get("bs1", {}).get("tok_s"), "bs1_decode_tok_s": main.get("bs1", {}).get("decode_tok_s"),
           "c128_tok_s": main.get("c128", {}).get("output_tok_s"), "ttft_ms": res.get("ttft_128_ms"),
           "startup_s": res.get("startup_s"), "gpu": report.get("gpu")}
    if error or not main:
        row["error"] = (error or "no Kestrel figures in the report")[:160]
    return row


def step_us(ar: dict | None, road: str) -> float | None:
    return ((ar or {}).get("decode_step_8b") or {}).get("us_per_step", {}).get(f"{road}_graph")


def build(folder: Path, model: str) -> dict:
    rows = []
    # bench_tp2.json, bench_tp2_nccl.json; not engine_bench's per-model parts beside them (bench_tp2.MODEL.kestrel.json)
    # A run the step's timeout cut wrote its log but no report: a row still, saying so.
    runs = sorted({(int(m[1]), bool(m[2]), p.with_suffix(".json")) for p in folder.glob("bench_tp*.*")
                   if p.suffix in (".json", ".log") and (m := re.fullmatch(r"bench_tp(\d+)(_nccl)?", p.stem))})
    for tp, nccl, path in runs:
        row = engine_row(load(path), model, path.with_suffix(".log"))
        # what the file name says, even where the run wrote nothing
        row.update(file=path.name, tp=tp, disable_custom_all_reduce=nccl)
        ar = load(folder / f"ar_tp{row['tp']}.json")
        row["ar_step_us_nccl"], row["ar_step_us_symm"] = step_us(ar, "nccl"), step_us(ar, "symm")
        rows.append(row)
    base = next((r.get("bs1_tok_s") for r in rows if r["tp"] == 1), None)
    for r in rows:
        r["speedup"] = r["bs1_tok_s"] / base if base and r.get("bs1_tok_s") else None
    targets = []
    for tp, want in SPEEDUP_TARGETS.items():
        got = next((r["speedup"] for r in rows if r["tp"] == tp and not r["disable_custom_all_reduce"]), None)
        targets.append({"what": f"bs1 decode TP={tp} >= {want}x TP=1", "value": got,
                        "met": None if got is None else got >= want})
    all_reduce = {int(m[1]): load(p.with_suffix(".json")) for p in sorted(folder.glob("ar_tp*.*"))
                  if p.suffix in (".json", ".log") and (m := re.fullmatch(r"ar_tp(\d+)", p.stem))}
    return {"model": model, "rows": rows, "targets": targets, "all_reduce": all_reduce,
            "sigterm": load(folder / "sigterm.json"), "tests": tests_line(folder / "tests.log")}


def tests_line(path: Path) -> str | None:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    found = [ln.strip("= ") for ln in lines if re.search(r"\b(passed|failed|error|skipped|no tests ran)\b", ln)]
    return found[-1] if found else (lines[-1] if lines else None)


def render(summary: dict, folder: Path = Path(".")) -> str:
    out = []
    for world, ar in summary["all_reduce"].items():
        if not ar:
            why = last_line(folder / f"ar_tp{world}.log") or "no log"
            out += [f"all-reduce bench at {world} ranks: no report ({why})", ""]
            continue
        state = "" if ar.get("complete") else f" (incomplete: {ar.get('error')})"
        backend = ar.get("backend", "nccl")   # gloo in a CPU smoke run
        symm = "on" if ar.get("symm_open") else "OFF: " + "; ".join(ar.get("symm_log", [])[-1:])
        out += [f"all-reduce, {ar.get('world_size', world)} x {ar.get('gpu')}, us per all-reduce in a CUDA graph "
                f"(eager){state}; symmetric memory {symm}", "",
                f"| message | route | {backend.upper()} | symm | correct |", "|---|---|---|---|---|"]
        for s in ar.get("sizes", []):
            cells, ok = [], True
            for road in (backend, "symm"):
                res = s["roads"].get(road, {})
                if not res.get("applicable", True):
                    cells.append("n/a")
                elif "error" in res:
                    cells.append(f"error: {res['error'][:40]}")
                    ok = False
                else:
                    cells.append(f"{fmt(res.get('graph_us'))} ({fmt(res.get('eager_us'))})" if res else "—")
                    ok = ok and res.get("correct", True) is not False and res.get("matches_nccl", True)
            size = s["bytes"]
            label = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KB"
            out.append(f"| {label} | {s['route']} | {cells[0]} | {cells[1]} | {'yes' if ok else 'NO'} |")
        out.append("")
    out += [f"{summary['model']} shape, engine_bench --graphs-only --skip-hf (bs1: 3 prompts of 128, 256 out; c128: "
            "128 x 128 in / 256 out):", "",
            "| TP | all-reduce | bs1 tok/s | vs TP=1 | c128 out tok/s | TTFT ms | startup s "
            "| AR us/step NCCL | AR us/step symm |", "|---|---|---|---|---|---|---|---|---|"]
    for r in summary["rows"]:
        road = ("—" if r["tp"] == 1 else "NCCL (flag)" if r["disable_custom_all_reduce"]
                else "symm + NCCL" if r.get("custom_all_reduce") else "NCCL (symm did not open)"
                if r.get("custom_all_reduce") is False else "?")
        if r.get("error"):
            out.append(f"| {r['tp']} | {road} | error: {r['error']} | | | | | | |")
            continue
        speed = f"{r['speedup']:.2f}x" if r.get("speedup") else "—"
        out.append(f"| {r['tp']} | {road} | {fmt(r['bs1_tok_s'])} | {speed} | {fmt(r['c128_tok_s'], 0)} "
                   f"| {fmt(r['ttft_ms'], 2)} | {fmt(r['startup_s'])} | {fmt(r['ar_step_us_nccl'], 0)} "
                   f"| {fmt(r['ar_step_us_symm'], 0)} |")
    out.append("")
    for t in summary["targets"]:
        verdict = "not measured" if t["met"] is None else "met" if t["met"] else "NOT met"
        value = "—" if t["value"] is None else f"{t['value']:.2f}x"
        out.append(f"target {t['what']}: {value}, {verdict}")
    sig = summary["sigterm"]
    if sig is None:
        out.append("SIGTERM check: did not run")
    else:
        out.append(f"SIGTERM at TP={sig.get('tensor_parallel_size')}: {'ok' if sig.get('ok') else 'FAILED'} "
                   f"(ready {sig.get('ready_s')} s, exit {sig.get('exit_s')} s, code {sig.get('returncode')}, "
                   f"{sig.get('workers_seen')} worker(s), left behind: {sig.get('left_behind') or 'none'}"
                   f"{', ' + sig['error'] if sig.get('error') else ''})")
    out.append(f"tests/gpu/test_tp_gpu.py: {summary['tests'] or 'did not run'}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args(argv)
    summary = build(args.folder, args.model)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    print(render(summary, args.folder))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
