"""Result files (JSON), the summary table printed after a run, and `bench compare` (markdown table, PNG plots)."""
from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kestrel.errors import KestrelError

Metric = tuple[str, Callable[[dict[str, Any]], float | None], bool]   # label, getter on a run, higher is better


def write_result(path: str, result: dict[str, Any]) -> None:
    file = Path(path)
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(json.dumps(result, indent=1) + "\n")


def load_result(path: str) -> dict[str, Any]:
    try:
        result = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise KestrelError(f"{path!r} is not a readable result file: {exc}") from exc
    if not isinstance(result, dict) or "runs" not in result:
        raise KestrelError(f"{path!r} is not a kestrel bench result: expected a JSON object with 'runs'")
    return result


def _stat(key: str, stat: str) -> Callable[[dict[str, Any]], float | None]:
    return lambda run: (run["summary"].get(key) or {}).get(stat)


def _top(key: str) -> Callable[[dict[str, Any]], float | None]:
    return lambda run: run["summary"].get(key)


def _cache(key: str) -> Callable[[dict[str, Any]], float | None]:
    return lambda run: (run.get("prefix_cache") or {}).get(key)


def _spec(key: str) -> Callable[[dict[str, Any]], float | None]:
    return lambda run: (run.get("spec_decode") or {}).get(key)


METRICS: list[Metric] = [
    ("output tok/s", _top("output_throughput"), True),
    ("total tok/s", _top("total_token_throughput"), True),
    ("requests/s", _top("request_throughput"), True),
    ("goodput req/s", _top("goodput"), True),
    ("tok/s per request (mean)", _stat("per_request_tok_s", "mean"), True),
    ("ms/token (mean)", _stat("ms_per_token", "mean"), False),
    ("TTFT ms mean", _stat("ttft_ms", "mean"), False),
    ("TTFT ms p50", _stat("ttft_ms", "p50"), False),
    ("TTFT ms p99", _stat("ttft_ms", "p99"), False),
    ("TPOT ms mean", _stat("tpot_ms", "mean"), False),
    ("TPOT ms p50", _stat("tpot_ms", "p50"), False),
    ("TPOT ms p99", _stat("tpot_ms", "p99"), False),
    ("ITL ms p50", _stat("itl_ms", "p50"), False),
    ("ITL ms p99", _stat("itl_ms", "p99"), False),
    ("E2E ms mean", _stat("e2e_ms", "mean"), False),
    ("E2E ms p99", _stat("e2e_ms", "p99"), False),
    ("spec acceptance rate", _spec("acceptance_rate"), True),
    ("spec mean accepted length", _spec("mean_accepted_length"), True),
    ("input tokens", _top("total_input_tokens"), False),
    ("output tokens", _top("total_output_tokens"), True),
    ("prefix cache hit rate", _cache("hit_rate"), True),
    ("failed requests", _top("failed"), False),
]


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, int) or (float(value).is_integer() and abs(value) >= 100):
        return f"{value:.0f}"
    return f"{value:.3g}" if abs(value) < 100 else f"{value:.1f}"


def summary_table(result: dict[str, Any]) -> str:
    """Fixed-width table of one result, one row per run (printed after `bench serve`)."""
    cols = [("run", lambda r: r["name"]), ("conc", lambda r: r["concurrency"] or "-"),
            ("ok/fail", lambda r: f"{r['summary']['completed']}/{r['summary']['failed']}"),
            ("in tok", _top("total_input_tokens")), ("out tok", _top("total_output_tokens")),
            ("cache hit", lambda r: _percent(_cache("hit_rate")(r))),
            ("req/s", _top("request_throughput")), ("out tok/s", _top("output_throughput")),
            ("tok/s/req", _stat("per_request_tok_s", "mean")), ("ms/tok", _stat("ms_per_token", "mean")),
            ("TTFT p50", _stat("ttft_ms", "p50")), ("TTFT p99", _stat("ttft_ms", "p99")),
            ("TPOT p50", _stat("tpot_ms", "p50")), ("ITL p50", _stat("itl_ms", "p50")),
            ("E2E p50", _stat("e2e_ms", "p50")), ("goodput", _top("goodput"))]
    rows = [[h for h, _ in cols]]
    for run in result["runs"]:
        rows.append([v if isinstance(v := get(run), str) else _fmt(v) for _, get in cols])
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(cols))]
    lines = ["  ".join(str(c).rjust(w) for c, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append("(times in ms; tok/s/req and ms/tok are per request, E2E based; in/out tok: tokens sent and "
                 "received, as the server counted them; cache hit: the server's prefix-cache hit rate over the run)")
    lines += [line for run in result["runs"] if (line := spec_decode_line(run))]
    return "\n".join(lines)


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def spec_decode_line(run: dict[str, Any]) -> str | None:
    """`[run] spec decode: acceptance rate 0.62, acceptance length 2.9, per position 0.8 0.6 0.5`; None when the
    server reported no speculative counters or drafted nothing in this run."""
    spec = run.get("spec_decode") or {}
    parts = [f"{label} {_fmt(spec[key])}" for label, key in (("acceptance rate", "acceptance_rate"),
                                                              ("acceptance length", "mean_accepted_length"))
             if spec.get(key) is not None]
    if spec.get("acceptance_rate_per_pos"):
        parts.append("per position " + " ".join(f"{r:.2f}" for r in spec["acceptance_rate_per_pos"]))
    return f"[{run['name']}] spec decode ({spec['source']}): " + ", ".join(parts) if parts else None


def _labels(results: Sequence[dict[str, Any]], labels: Sequence[str] | None) -> list[str]:
    if labels and len(labels) != len(results):
        raise KestrelError(f"--labels {list(labels)} is invalid: expected {len(results)} labels, one per file")
    return list(labels) if labels else [r.get("label") or f"run{i}" for i, r in enumerate(results)]


def compare_markdown(results: Sequence[dict[str, Any]], labels: Sequence[str] | None = None) -> str:
    """One markdown table per run name: rows are metrics, columns are systems, plus each ratio to the first."""
    labels = _labels(results, labels)
    names = list(dict.fromkeys(run["name"] for result in results for run in result["runs"]))
    out = []
    for name in names:
        runs = [next((run for run in result["runs"] if run["name"] == name), None) for result in results]
        header = ["metric", labels[0]]
        for label in labels[1:]:
            header += [label, f"{label} / {labels[0]}"]
        first = runs[0]
        conc = next((r["concurrency"] for r in runs if r), None)
        out.append(f"### {name}" + (f" (concurrency {conc})" if conc else ""))
        out.append("| " + " | ".join(header) + " |")
        out.append("|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|")
        for metric, get, _higher in METRICS:
            values = [get(run) if run else None for run in runs]
            if all(v is None for v in values):
                continue
            row = [metric, _fmt(values[0])]
            base = values[0] if first else None
            for v in values[1:]:
                ratio = f"{v / base:.2f}x" if v is not None and base else "-"
                row += [_fmt(v), ratio]
            out.append("| " + " | ".join(row) + " |")
        out.append("")
    return "\n".join(out)


def plot_comparison(results: Sequence[dict[str, Any]], out_dir: str,
                    labels: Sequence[str] | None = None) -> list[str]:
    """throughput_vs_concurrency.png, ttft_cdf.png, tpot_cdf.png (the last two only with streamed runs)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from kestrel.bench.metrics import tpot

    labels = _labels(results, labels)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    written = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, result in zip(labels, results):
        points = sorted((r["concurrency"], r["summary"]["output_throughput"]) for r in result["runs"]
                        if r["concurrency"] and r["stream"] == _stream_preference(result))
        if points:
            ax.plot(*zip(*points), marker="o", label=label)
    ax.set(xscale="log", xlabel="concurrency", ylabel="output tok/s", title="Throughput vs concurrency")
    ax.grid(True, alpha=0.3)
    ax.legend()
    written.append(_save(fig, Path(out_dir) / "throughput_vs_concurrency.png"))

    for metric, title, getter in (("ttft", "TTFT", lambda r: r["ttft"]), ("tpot", "TPOT", tpot)):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        drawn = False
        for label, result in zip(labels, results):
            for run in result["runs"]:
                values = [getter(r) for r in run["requests"] if r["success"]]
                values = np.sort([v * 1000.0 for v in values if v is not None])
                if len(values):
                    ax.step(values, np.arange(1, len(values) + 1) / len(values), where="post",
                            label=f"{label} {run['name']}")
                    drawn = True
        if drawn:
            ax.set(xlabel=f"{title} (ms)", ylabel="fraction of requests", title=f"{title} CDF")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize="small")
            written.append(_save(fig, Path(out_dir) / f"{metric}_cdf.png"))
        else:
            plt.close(fig)
    return written


def write_report(results: Sequence[dict[str, Any]], out_dir: str, labels: Sequence[str] | None = None) -> list[str]:
    """DIR/comparison.md and the PNG plots: what `bench compare --output-dir` and `bench serve --output-dir`
    write. Returns the paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    table = out / "comparison.md"
    table.write_text(compare_markdown(results, labels))
    return [str(table), *plot_comparison(results, str(out), labels)]


def _stream_preference(result: dict[str, Any]) -> bool:
    # single-and-peak has each concurrency twice; plot the streamed runs when there are any.
    return any(r["stream"] for r in result["runs"])


def _save(fig, path: Path) -> str:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
