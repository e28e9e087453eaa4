"""The profile stage's A/Bs in one table: each switch's bs1 step against the baseline of the same call.

    python -m benchmarks.ab_summary OUT_DIR    (reads OUT_DIR/profile.json and OUT_DIR/profile_ab_*.json)
    python -m benchmarks.ab_summary OUT_DIR --best SWITCHES   (prints the fastest switch, see best_switch)

An A/B file is named profile_ab_<model>_<switch>.json by scripts/gpu_suite.sh; its model comes from the JSON.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


WATCHED = {"_skinny_matmul_kernel": "skinny_exposed_us", "_decode_kernel": "decode_exposed_us"}


def _watched(result: dict) -> dict:
    """Exposed us per launch of the kernels most A/Bs move (absent in older JSON: None)."""
    found = {k["name"]: k.get("exposed_us_each") for k in result.get("kernels", [])}
    return {key: found.get(name) for name, key in WATCHED.items()}


def ab_rows(out_dir: Path) -> list[dict]:
    """One row per A/B file whose model has a baseline: model, switch (from the file name), step ms, change, and
    the skinny-matmul and decode kernels' exposed us per launch."""
    baseline = {r["model"]: r["engine_step_ms"] for r in json.loads((out_dir / "profile.json").read_text())}
    rows = []
    for path in sorted(out_dir.glob("profile_ab_*.json")):
        for r in json.loads(path.read_text()):
            base = baseline.get(r["model"])
            if base is None:
                continue
            prefix = f"profile_ab_{r['model']}_"
            switch = path.stem[len(prefix):] if path.stem.startswith(prefix) else path.stem   # '=' and '+' as '_'
            rows.append({"model": r["model"], "switch": switch, "step_ms": r["engine_step_ms"], "base_ms": base,
                         "change_pct": 100 * (r["engine_step_ms"] / base - 1), **_watched(r)})
    return rows


def best_switch(rows: list[dict], switches: dict[str, str], min_gain_pct: float = 1.0) -> str | None:
    """The switch, as written in the A/B list ('+' joining variables), of the fastest A/B that beat its baseline by
    at least min_gain_pct; None if none did. switches maps '<model>_<switch as in the file name>' to it.
    The profile's own switches (KESTREL_PROFILE_*: ablations, which take work out of the step and give garbage
    tokens, and the engine's sizes) are probes, never picked."""
    winners = [r for r in rows if r["change_pct"] <= -min_gain_pct and "KESTREL_PROFILE_" not in r["switch"]]
    if not winners:
        return None
    best = min(winners, key=lambda r: r["change_pct"])
    return switches.get(f"{best['model']}_{best['switch']}")


def read_switches(path: Path) -> dict[str, str]:
    """Lines '<model>_<switch as in the file name> <switch>' written by scripts/gpu_suite.sh's A/B loop."""
    pairs = (line.split(maxsplit=1) for line in path.read_text().splitlines() if line.strip())
    return {key: switch.strip() for key, switch in pairs}


def markdown(rows: list[dict]) -> str:
    def us(value: float | None) -> str:
        return "" if value is None else f"{value:.2f}"
    lines = ["| model | switch | step ms | baseline ms | change | skinny exposed us | decode exposed us |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['switch']} | {r['step_ms']:.3f} | {r['base_ms']:.3f} | {r['change_pct']:+.1f}% "
              f"| {us(r.get('skinny_exposed_us'))} | {us(r.get('decode_exposed_us'))} |" for r in rows]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--best", type=Path, metavar="SWITCHES",
                    help="print the fastest A/B's switch (>= 1%% faster than its baseline), or nothing")
    args = ap.parse_args()
    if not (args.out_dir / "profile.json").exists():
        print("no profile.json: the profile stage did not run or did not finish")
        return 0
    rows = ab_rows(args.out_dir)
    if args.best is not None:
        print(best_switch(rows, read_switches(args.best)) or "")
        return 0
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
