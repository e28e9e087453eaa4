"""Markdown from one benchmarks/engine_bench.py report: its full tables (and CUDA-vs-HF parity, given one).

    python -m benchmarks.report bench.json [--parity gpu_parity.json] [--append FILE.md --commit SHA]
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


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("bench_json", nargs="?")
    ap.add_argument("--parity", default=None)
    ap.add_argument("--append", default=None, help="append the table to this markdown file")
    ap.add_argument("--commit", default=None)
    args = ap.parse_args()
    if not args.bench_json:
        ap.error("a bench JSON file is needed")
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
