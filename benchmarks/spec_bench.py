"""Speculative decoding on the GPU: speedup over no speculation, in one process, on random weights in real shapes.

The target is a random-weight checkpoint of a real shape (benchmarks/shapes.py, default the Llama-3.1-8B shape)
and the drafter a random EAGLE-3 drafter of the standard size for it (hidden 4096, 32 heads, FFN 14336, draft
vocabulary 32,000). Random weights accept nothing, so the synthetic acceptance mode fixes the chance that each
draft position passes; with K drafts, acceptance length L = 1 + p + ... + p^K picks p:

    bs1 decode (3 prompts of 128 tokens, 256 new each, one at a time): no speculation; K-chain at L = 1.15, 2, 3,
        4 (fixed depth); the adaptive policy at L = 1.15 and 3
    128 concurrent (128 in / 256 out): no speculation vs the adaptive policy at L = 3 and 1.15
    the per-step time split of a fixed-depth step (draft, verify, bookkeeping), synchronized
    through `kestrel serve` (--serve): one stream, no speculation vs K-chain at L = 3

Every timed run sends prompts of its own (none shares a prefix with anything sent before, warm-ups included),
ignore_eos (the same output tokens with and without speculation), and its rows carry output_tokens and
prefix_cache_hit_rate.

    python -m benchmarks.spec_bench --workdir /tmp/kestrel-bench --out spec.json [--serve]
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.engine_bench import run_requests, single_stream
from benchmarks.shapes import SHAPES, write_random_checkpoint
from kestrel.bench.fresh import FreshPrompts
from kestrel.config import EngineConfig
from kestrel.engine.engine import Engine

log = logging.getLogger("spec_bench")
LENGTHS = (1.15, 2.0, 3.0, 4.0)


def rate_for_length(length: float, k: int) -> float:
    """The per-position acceptance p with 1 + p + ... + p^k = length (bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid ** j for j in range(k + 1)) < length:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def checkpoints(workdir: Path, shape: str) -> tuple[Path, Path]:
    from kestrel.models.checkpoint import load_model_config
    from kestrel.models.eagle3_loader import random_eagle3_checkpoint

    target = workdir / shape
    if not (target / ".complete").exists():
        write_random_checkpoint(shape, target)
    drafter = workdir / f"{shape}-eagle3"
    if not (drafter / "config.json").exists():
        random_eagle3_checkpoint(drafter, load_model_config(target), draft_vocab_size=32000)
    return target, drafter


def acceptance(engine: Engine, before: tuple[int, int, int]) -> dict:
    c = engine.spec.counters
    drafts, tokens, accepted = (c.num_drafts - before[0], c.num_draft_tokens - before[1],
                                c.num_accepted_tokens - before[2])
    return {"acceptance_rate": accepted / tokens if tokens else None,
            "acceptance_length": 1 + accepted / drafts if drafts else None, "verify_steps": drafts}


def counters(engine: Engine) -> tuple[int, int, int]:
    c = engine.spec.counters
    return c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens


def c128(engine: Engine, prompts: list[list[int]], output_len: int) -> dict:
    """Every prompt at once (128 of them on the GPU), output_len tokens each (ignore_eos): output tok/s, the output
    token count and the prompts' prefix-cache hit rate."""
    r = run_requests(engine, prompts, output_len)
    return {"output_tok_s": r["output_tokens"] / r["wall_s"], "wall_s": r["wall_s"],
            "output_tokens": r["output_tokens"],
            **{k: v for k, v in r.items() if k.startswith("prefix_cache_")}}


def warm_up(engine: Engine, fresh: FreshPrompts, prompt_len: int, concurrency: int) -> None:
    """One prompt alone, then `concurrency` at once: the timed runs' shapes, with prompts never sent again."""
    run_requests(engine, fresh.take(1, prompt_len), 8)
    run_requests(engine, fresh.take(concurrency, prompt_len), 4)


def bench_offline(target: Path, drafter: Path, k: int, output_len: int, tree_topk: int = 3,
                  quick: bool = False, *, device: str = "cuda", prompt_len: int = 128, concurrency: int = 128,
                  bs1_prompts: int = 3) -> dict:
    """quick: bs1 only (no speculation, fixed L = 3, adaptive L = 1.15, the tree at L = 3) for a short run.

    Every timed run gets prompts of its own (FreshPrompts: no prefix shared with any prompt sent before, warm-ups
    included), generates output_len tokens a prompt (ignore_eos: with and without speculation the same work), and
    carries its output token count and prefix-cache hit rate. device / prompt_len / concurrency: the CPU test's
    small sizes; the GPU run keeps the defaults."""
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    fresh = FreshPrompts(vocab, seed=0)
    out: dict = {"workload": {"prompt_len": prompt_len, "output_len": output_len, "concurrency": concurrency,
                              "bs1_prompts": bs1_prompts, "ignore_eos": True,
                              "prompts": "random token ids, each new (distinct first token), warm-ups included"}}
    common = dict(model=str(target), device=device, cuda_graph_max_bs=128, max_num_seqs=max(256, concurrency))

    def bs1(engine: Engine) -> dict:
        return single_stream(engine, fresh.take(bs1_prompts, prompt_len), output_len)

    def conc(engine: Engine) -> dict:
        return c128(engine, fresh.take(concurrency, prompt_len), output_len)

    engine = Engine(EngineConfig(**common))
    warm_up(engine, fresh, prompt_len, concurrency)
    out["plain"] = {"bs1": bs1(engine)}
    if not quick:
        out["plain"]["c128"] = conc(engine)
    log.info("plain: %s", out["plain"])
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

    spec = {"method": "eagle3", "model": str(drafter), "num_speculative_tokens": k,
            "synthetic_acceptance_rate": 1.0}
    t0 = time.perf_counter()
    engine = Engine(EngineConfig(speculative_config=spec, **common))
    out["spec_startup_s"] = time.perf_counter() - t0
    warm_up(engine, fresh, prompt_len, concurrency)
    sd = engine.spec

    def variant(length: float, adaptive: bool, concurrent: bool = False) -> dict:
        sd.synthetic_rate = rate_for_length(length, k)
        sd.policy.adaptive = adaptive
        before = counters(engine)
        row = {"target_length": length, "synthetic_rate": sd.synthetic_rate, "adaptive": adaptive}
        row.update(conc(engine) if concurrent else bs1(engine))
        row.update(acceptance(engine, before))
        log.info("%s", row)
        return row

    out["bs1_fixed"] = [variant(length, adaptive=False) for length in ((3.0,) if quick else LENGTHS)]
    out["bs1_adaptive"] = [variant(length, adaptive=True) for length in ((1.15,) if quick else (1.15, 3.0))]
    out["c128_adaptive"] = [] if quick else [variant(length, adaptive=True, concurrent=True)
                                             for length in (3.0, 1.15)]
    sd.synthetic_rate, sd.policy.adaptive = rate_for_length(3.0, k), False
    sd.timing = {}
    split = single_stream(engine, fresh.take(1, prompt_len), output_len)
    steps = sd.timing.pop("steps", 1)
    out["step_split_ms_L3"] = {name: 1000 * s / steps for name, s in sd.timing.items()}
    out["step_split_ms_L3"]["steps"] = steps
    out["step_split_prefix_cache_hit_rate"] = split["prefix_cache_hit_rate"]
    sd.timing = None
    out["policy_step_times_ms"] = {f"{b}x{d}": round(1000 * t, 3) for (b, d), t in sd.policy.step_time.items()}
    engine = sd = None   # free the GPU for the tree engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    out["bs1_tree"] = bench_tree(common, spec, fresh, prompt_len, bs1_prompts, k, tree_topk, output_len,
                                 (3.0,) if quick else (2.0, 3.0))
    return out


def bench_tree(common: dict, spec: dict, fresh: FreshPrompts, prompt_len: int, bs1_prompts: int, k: int, topk: int,
               output_len: int, lengths: tuple[float, ...]) -> list[dict]:
    """bs1 with a tree of K steps x topk candidates (forward/draft_tree.py); the synthetic mode accepts along its
    chain, so at a given acceptance length this is the chain's speed minus the cost of verifying the larger tree."""
    engine = Engine(EngineConfig(speculative_config=dict(spec, topk=topk), **common))
    run_requests(engine, fresh.take(1, prompt_len), 8)
    sd = engine.spec
    sd.policy.adaptive = False
    rows = []
    for length in lengths:
        sd.synthetic_rate = rate_for_length(length, k)
        before = counters(engine)
        row = {"target_length": length, "synthetic_rate": sd.synthetic_rate, "topk": topk,
               "draft_tokens": sd.tree.size}
        row.update(single_stream(engine, fresh.take(bs1_prompts, prompt_len), output_len))
        row.update(acceptance(engine, before))
        log.info("tree %s", row)
        rows.append(row)
    return rows   # the engine goes with this frame


def bench_serve(target: Path, drafter: Path, k: int, output_len: int, raw: Path) -> dict:
    """One stream through `kestrel serve`, without and with speculation (L = 3), launched and measured by the
    project's own launcher and load generator."""
    out = {}
    spec = json.dumps({"method": "eagle3", "model": str(drafter), "num_speculative_tokens": k,
                       "synthetic_acceptance_rate": rate_for_length(3.0, k), "adaptive": False})
    for label, extra in (("plain", []), ("eagle3_L3", ["--speculative-config", spec])):
        result = raw / f"spec_serve_{label}.json"
        serve = [sys.executable, "-m", "kestrel.cli", "serve", str(target), "--port", "8013", *extra]
        bench = (f"{sys.executable} -m kestrel.cli bench serve --base-url {{base_url}} --concurrency 1 "
                 f"--num-prompts 4 --input-len 128 --output-len {output_len} --label {label} --no-progress "
                 f"--output {result}")
        cmd = [sys.executable, "-m", "kestrel.cli", "launch", "--name", f"spec-{label}", "--port", "8013",
               "--ready-timeout", "300", "--stall-timeout", "60", "--then", bench, "--", *serve]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=420)
        if proc.returncode != 0 or not result.exists():
            logs = sorted(Path("logs").glob(f"spec-{label}-*.log"))
            server_log = logs[-1].read_text()[-2000:] if logs else ""
            out[label] = {"error": (proc.stdout + proc.stderr)[-800:] + "\nserver log: " + server_log}
            continue
        out[label] = json.loads(result.read_text())
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default="/tmp/kestrel-bench")
    ap.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--serve", action="store_true")
    ap.add_argument("--serve-only", action="store_true", help="skip the offline runs")
    ap.add_argument("--quick", action="store_true", help="bs1 rows only: none, L=3 fixed, L=1.15 adaptive, tree")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    target, drafter = checkpoints(workdir, args.shape)
    results = {"gpu": torch.cuda.get_device_name(), "shape": args.shape, "k": args.k,
               "date": time.strftime("%Y-%m-%d"), "output_len": args.output_len}
    if not args.serve_only:
        results["offline"] = bench_offline(target, drafter, args.k, args.output_len, quick=args.quick)
        Path(args.out).write_text(json.dumps(results, indent=1))
    gc.collect()   # the offline engines hold most of the GPU: the servers below need it
    torch.cuda.empty_cache()
    if args.serve or args.serve_only:
        results["serve"] = bench_serve(target, drafter, args.k, args.output_len, Path(args.out).parent)
        Path(args.out).write_text(json.dumps(results, indent=1))
    print(summary_table(results))
    return 0


def summary_table(r: dict) -> str:
    if "offline" not in r:
        return _serve_lines(r)
    return _offline_lines(r) + "\n" + _serve_lines(r)


def _offline_lines(r: dict) -> str:
    off = r["offline"]
    base = off["plain"]["bs1"]["decode_tok_s"]
    lines = [f"speculative decoding · {r['gpu']} · {r['shape']} · K={r['k']} chain · {r['date']}", "",
             "| run | acceptance length | bs1 decode tok/s | vs none |", "|---|---:|---:|---:|",
             f"| none | — | {base:.1f} | 1.00x |"]
    for row in off["bs1_fixed"] + off["bs1_adaptive"]:
        name = f"{'adaptive' if row['adaptive'] else 'fixed'} L={row['target_length']}"
        al = row["acceptance_length"]
        lines.append(f"| {name} | {al:.2f} | {row['decode_tok_s']:.1f} | {row['decode_tok_s'] / base:.2f}x |"
                     if al else f"| {name} | — | {row['decode_tok_s']:.1f} | {row['decode_tok_s'] / base:.2f}x |")
    for row in off.get("bs1_tree", []):
        lines.append(f"| tree K={r['k']}x{row['topk']} ({row['draft_tokens']} nodes) fixed L={row['target_length']} "
                     f"| {row['acceptance_length']:.2f} | {row['decode_tok_s']:.1f} | "
                     f"{row['decode_tok_s'] / base:.2f}x |")
    if "c128" not in off["plain"]:
        return "\n".join(lines + ["", f"step split at L=3 (ms): {off['step_split_ms_L3']}"])
    c_base = off["plain"]["c128"]["output_tok_s"]
    lines += ["", "| 128 concurrent | out tok/s | vs none |", "|---|---:|---:|", f"| none | {c_base:.0f} | 1.00x |"]
    for row in off["c128_adaptive"]:
        lines.append(f"| adaptive L={row['target_length']} | {row['output_tok_s']:.0f} | "
                     f"{row['output_tok_s'] / c_base:.2f}x |")
    lines += ["", f"step split at L=3 (ms): {off['step_split_ms_L3']}"]
    return "\n".join(lines)


def _serve_lines(r: dict) -> str:
    lines = []
    serve = r.get("serve")
    if serve:
        def tps(x: dict) -> str:
            try:
                return f"{x['runs'][0]['summary']['output_throughput']:.1f}"
            except (KeyError, IndexError, TypeError):
                return str(x.get("error", "?"))[-300:]
        lines.append(f"through kestrel serve, one stream: none {tps(serve['plain'])} tok/s, "
                     f"K-chain L=3 {tps(serve['eagle3_L3'])} tok/s")
        try:
            lines.append(f"  server's acceptance: {serve['eagle3_L3']['runs'][0]['spec_decode']}")
        except (KeyError, IndexError, TypeError):
            pass
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
