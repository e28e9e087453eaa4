"""The short table of benchmarks/moe_bench.py reports, one column a shape (what lab/scripts/moe_gpu.sh prints
last).

    python -m lab.moe_table out/qwen3-30b-a3b.json out/deepseek-v3-small.json
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def _num(value, fmt: str = ",.1f") -> str:
    return "—" if value is None else format(value, fmt)


def rows(report: dict) -> dict[str, str]:
    """Label -> cell of one report; a stage a timeout cut off shows as —."""
    roof = report.get("roofline", {})
    c = report.get("workload", {}).get("concurrency", 128)
    bs1, conc = report.get("bs1", {}), report.get(f"c{c}", {})
    kv_same = report.get("kv_bytes_per_token_same_width", {})
    prof = report.get("bs1_kernel_profile", {})
    gqa = ", ".join(f"{k} {v:,}" for k, v in kv_same.items())
    return {
        "device": report.get("gpu") or report.get("device", "?"),
        "copy bandwidth, GB/s (read + written)": _num(report.get("copy_bandwidth_gb_s")),
        "startup, s": _num(report.get("startup_s")),
        "decode graphs / experts": f"{report.get('decode_cuda_graphs')} / "
                                   f"{str(report.get('experts_impl')).rsplit('.', 1)[-1]}",
        "weights, GB (active a token)": f"{_num(_gb(report.get('weight_bytes')), '.2f')} "
                                        f"({_num(_gb(roof.get('active_weight_bytes_per_token')), '.3f')})",
        "bs1 decode tok/s": _num(bs1.get("decode_tok_s")),
        "bs1 roofline tok/s": _num(roof.get("bs1_roofline_tok_s")),
        "bs1 fraction (target >= 0.65)": _num(bs1.get("fraction_of_roofline"), ".3f"),
        "bs1 profiled: us a step, launches a step": f"{_num(prof.get('us_per_step'))}, "
                                                    f"{_num(prof.get('launches_per_step'), '.0f')}",
        "concurrent requests": str(c),
        "concurrent output tok/s (decode after last TTFT)": f"{_num(conc.get('output_tok_s'))} "
                                                            f"({_num(conc.get('decode_tok_s'))})",
        "concurrent roofline tok/s (experts touched a layer)":
            f"{_num(roof.get(f'c{c}_roofline_tok_s'))} ({_num(roof.get(f'c{c}_expected_touched_experts_per_layer'))})",
        "concurrent decode fraction": _num(conc.get("fraction_of_roofline"), ".3f"),
        "KV bytes/token": _num(report.get("kv_bytes_per_token"), ","),
        "same width, KV bytes/token": gqa or "—",
        "error": report.get("error", ""),
    }


def _gb(value) -> float | None:
    return None if value is None else value / 1e9


def table(reports: dict[str, dict]) -> str:
    columns = {name: rows(r) for name, r in reports.items()}
    labels = list(next(iter(columns.values()))) if columns else []
    lines = ["| | " + " | ".join(columns) + " |", "|---|" + "---:|" * len(columns)]
    for label in labels:
        cells = [columns[name].get(label, "—") for name in columns]
        if label == "error" and not any(cells):
            continue
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def load(paths: list[str]) -> dict[str, dict]:
    reports = {}
    for path in paths:
        try:
            report = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            report = {"error": f"no report: {exc}"}
        reports[report.get("shape") or Path(path).stem] = report
    return reports


def main(argv: list[str] | None = None) -> int:
    print(table(load(sys.argv[1:] if argv is None else argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
