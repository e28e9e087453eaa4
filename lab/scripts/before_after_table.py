"""The before/after table of lab/scripts/before_after.sh: each figure per run, then base vs cur as the median of
each tree's runs and the change.

    python3 lab/scripts/before_after_table.py OUT_DIR GPU BASE_COMMIT CUR_COMMIT
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def bench_figures(path: Path) -> dict[str, float]:
    m = json.loads(path.read_text())["models"]["llama-3.1-8b"]
    (road, v), = m["kestrel"].items()
    return {"bs1 decode tok/s": v["bs1"]["decode_tok_s"], "c128 out tok/s": v["c128"]["output_tok_s"],
            "TTFT ms": m["ttft_128_ms"], "startup s": m["startup_s"]}


def spec_figures(path: Path) -> dict[str, float]:
    off = json.loads(path.read_text())["offline"]
    fixed = {row["target_length"]: row for row in off["bs1_fixed"]}
    adaptive = {row["target_length"]: row for row in off["bs1_adaptive"]}
    out = {"spec: plain bs1 tok/s": off["plain"]["bs1"]["decode_tok_s"],
           "spec: EAGLE-3 K=3 L=3 bs1 tok/s": fixed[3.0]["decode_tok_s"]}
    if 1.15 in adaptive:
        out["spec: adaptive L=1.15 bs1 tok/s"] = adaptive[1.15]["decode_tok_s"]
    for row in off.get("bs1_tree", []):
        out[f"spec: tree L={row['target_length']} bs1 tok/s"] = row["decode_tok_s"]
    return out


def main() -> None:
    out, gpu, base_commit, cur_commit = Path(sys.argv[1]), *sys.argv[2:5]
    runs: dict[str, dict[str, list[float]]] = {"base": {}, "cur": {}}   # tree -> figure -> one value a run
    lines = [f"before/after · {gpu} · base {base_commit} · cur {cur_commit}", "", "| run | figures |", "|---|---|"]
    for path in sorted(out.glob("*.json")):
        kind, tree, _ = path.stem.split("_")
        if kind == "prof":
            p = json.loads(path.read_text())["profile"]
            lines.append(f"| {path.stem} | wall {p['wall_ms']:.2f} ms/step, device busy {p['device_busy_ms']:.2f}, "
                         + ", ".join(f"{k} {v:.2f}" for k, v in p["by_category_ms"].items()) + " |")
            continue
        try:
            figures = bench_figures(path) if kind == "bench" else spec_figures(path)
        except Exception as exc:   # noqa: BLE001 - a failed run says why in its row
            lines.append(f"| {path.stem} | {type(exc).__name__}: {str(exc)[:100]} |")
            continue
        lines.append(f"| {path.stem} | " + ", ".join(f"{k} {v:.2f}" for k, v in figures.items()) + " |")
        for k, v in figures.items():
            runs.setdefault(tree, {}).setdefault(k, []).append(v)
    lines += ["", "| figure | tree | median (runs) | / base |", "|---|---|---:|---:|"]
    figures = {k for tree in runs.values() for k in tree}
    for k in sorted(figures):
        if k not in runs["base"]:
            continue
        b = statistics.median(runs["base"][k])
        for tree in ["base", "cur", *sorted(set(runs) - {"base", "cur"})]:
            if k in runs[tree]:
                v = statistics.median(runs[tree][k])
                lines.append(f"| {k} | {tree} | {v:.2f} ({len(runs[tree][k])}) | {v / b:.3f} |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
