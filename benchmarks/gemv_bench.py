"""Skinny matmuls at decode batch sizes: cuBLAS vs kestrel/layers/gemv.py, plain and with the fused prologues.

For each layer shape (Qwen3-0.6B, Llama-3.1-8B) and M in {1, 4, 8, 16}, times inside CUDA graphs:
  cublas   F.linear(x, w)
  gemv     gemv(x, w), with the default config and a few alternatives (the best is reported, to tune the table)
  unfused  qkv / gate_up: fused_ops.rms_norm(x, nw, eps, residual) + F.linear;  down: silu_and_mul + F.linear
  fused    add_rms_norm_gemv / silu_mul_gemv (default config)
Each graph holds CALLS back-to-back calls that cycle through enough weight copies (> 200 MB together) that every
call reads its weight from HBM, not from the 60 MB L2, as a decode step's layers do. Effective TB/s counts the
weight bytes only. Prints a markdown table, writes JSON (--out).

    python -m benchmarks.gemv_bench --out /tmp/gemv_bench.json
"""
from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Callable

import torch
import torch.nn.functional as F

from benchmarks import write_json
from kestrel.layers import fused_ops
from kestrel.layers.gemv import GemvConfig, add_rms_norm_gemv, default_config, gemv, silu_mul_gemv

SHAPES = {  # name: (K, N, prologue the layer takes in the model)
    "0.6b.qkv": (1024, 4096, "rms"), "0.6b.o": (2048, 1024, None),
    "0.6b.gate_up": (1024, 6144, "rms"), "0.6b.down": (3072, 1024, "silu"),
    "8b.qkv": (4096, 6144, "rms"), "8b.o": (4096, 4096, None),
    "8b.gate_up": (4096, 28672, "rms"), "8b.down": (14336, 4096, "silu"),
}
BATCHES = (1, 4, 8, 16)
CALLS = 50                     # calls per captured graph
WEIGHT_BYTES = 200 << 20       # weight copies cycled per graph, together at least this many bytes
EPS = 1e-6


def alternatives(m: int, n: int, k: int, count: int) -> list[GemvConfig]:
    """The default config first, then neighbours: half / double BLOCK_N, 8 warps, the other K-loop style."""
    base = default_config(m, n, k)
    alts = [dataclasses.replace(base, block_n=max(base.block_n // 2, 4), block_k=base.block_k * 2),
            dataclasses.replace(base, block_n=base.block_n * 2, block_k=max(base.block_k // 2, 128)),
            dataclasses.replace(base, num_warps=8),
            dataclasses.replace(base, unroll=not base.unroll, num_stages=1 if not base.unroll else 3)]
    out = [base]
    for cfg in alts:
        if len(out) > count:
            break
        if cfg not in out and (not cfg.unroll or k // cfg.block_k <= 32):   # keep unrolled code small
            out.append(cfg)
    return out


def graph_time_us(step: Callable[[int], object]) -> float:
    """Microseconds per call of step(i), from CUDA-graph replays of CALLS consecutive calls."""
    for i in range(3):                     # compile / warm up outside the capture
        step(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(CALLS):
            step(i)
    return replay_time_us(graph) / CALLS


def replay_time_us(graph: torch.cuda.CUDAGraph, replays: int = 5) -> float:
    """Microseconds per replay of a captured graph: the best of three batches of `replays`, the least disturbed."""
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(3):
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / replays)
    return best


def bench_shape(name: str, m: int, weights: list[torch.Tensor], alt_count: int) -> dict:
    k, n, prologue = SHAPES[name]
    dtype, dev = weights[0].dtype, weights[0].device
    gen = torch.Generator(device=dev).manual_seed(m)
    x = torch.randn(m, k, generator=gen, device=dev).to(dtype)
    residual = torch.randn(m, k, generator=gen, device=dev).to(dtype)
    norm_w = (1 + 0.1 * torch.randn(k, generator=gen, device=dev)).to(dtype)
    gate_up = torch.randn(m, 2 * k, generator=gen, device=dev).to(dtype)
    w = lambda i: weights[i % len(weights)]   # noqa: E731
    row = {"shape": name, "M": m, "K": k, "N": n, "weight_mb": n * k * weights[0].element_size() / 1e6}
    row["cublas_us"] = graph_time_us(lambda i: F.linear(x, w(i)))
    tried = []
    for cfg in alternatives(m, n, k, alt_count):
        try:
            tried.append((graph_time_us(lambda i, c=cfg: gemv(x, w(i), config=c)), cfg))
        except Exception as exc:               # a config the compiler rejects (e.g. out of shared memory)
            print(f"  {name} M={m} {cfg}: {type(exc).__name__}: {str(exc)[:200]}")
    row["gemv_default_us"] = tried[0][0] if tried and tried[0][1] == default_config(m, n, k) else None
    best_us, best_cfg = min(tried, key=lambda t: t[0])
    row.update(gemv_us=best_us, gemv_best_config=dataclasses.asdict(best_cfg),
               gemv_all={str(dataclasses.astuple(c)): us for us, c in tried})
    if prologue == "rms":
        row["unfused_us"] = graph_time_us(lambda i: F.linear(fused_ops.rms_norm(x, norm_w, EPS, residual)[0], w(i)))
        row["fused_us"] = graph_time_us(lambda i: add_rms_norm_gemv(x, residual, norm_w, EPS, w(i)))
    elif prologue == "silu":
        row["unfused_us"] = graph_time_us(lambda i: F.linear(fused_ops.silu_and_mul(gate_up), w(i)))
        row["fused_us"] = graph_time_us(lambda i: silu_mul_gemv(gate_up, w(i)))
    return row


def weight_copies(k: int, n: int, dtype: torch.dtype) -> list[torch.Tensor]:
    one = torch.randn(n, k, device="cuda", dtype=dtype) / k ** 0.5
    copies = max(2, -(-WEIGHT_BYTES // one.nbytes))
    return [one] + [one.clone() for _ in range(copies - 1)]


def bench_all(shapes: dict[str, tuple[int, int]], batches: list[int], bench: Callable[[str, int, list], dict],
              describe: Callable[[dict], str]) -> list[dict]:
    """bench(name, m, weight copies) for each shape (K, N) and batch size, one shape's copies in memory at a time;
    a progress line per row."""
    t0 = time.perf_counter()
    rows = []
    for name, (k, n) in shapes.items():
        weights = weight_copies(k, n, torch.bfloat16)
        for m in batches:
            rows.append(bench(name, m, weights))
            print(f"  {name} M={m}: {describe(rows[-1])} ({time.perf_counter() - t0:.0f} s)", flush=True)
        del weights
        torch.cuda.empty_cache()
    return rows


def tbps(weight_mb: float, us: float | None) -> str:
    return "" if us is None else f"{weight_mb / us:.2f}"


def print_table(rows: list[dict]) -> None:
    print("| shape | M | weight MB | cuBLAS us (TB/s) | gemv us (TB/s) | gemv default us | best config "
          "| norm/silu + cuBLAS us | fused us (TB/s) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        c = r["gemv_best_config"]
        cfg = f"N{c['block_n']} K{c['block_k']} {'dot' if c['use_dot'] else 'bc'} w{c['num_warps']}" \
              f"{' unroll' if c['unroll'] else ' s' + str(c['num_stages'])}"
        default = "" if r["gemv_default_us"] is None else f"{r['gemv_default_us']:.2f}"
        unfused = f"{r['unfused_us']:.2f}" if "unfused_us" in r else ""
        fused = f"{r['fused_us']:.2f} ({tbps(r['weight_mb'], r['fused_us'])})" if "fused_us" in r else ""
        print(f"| {r['shape']} | {r['M']} | {r['weight_mb']:.1f} | {r['cublas_us']:.2f} "
              f"({tbps(r['weight_mb'], r['cublas_us'])}) | {r['gemv_us']:.2f} ({tbps(r['weight_mb'], r['gemv_us'])}) "
              f"| {default} | {cfg} | {unfused} | {fused} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="gemv_bench.json")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated names from SHAPES")
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)))
    parser.add_argument("--alts", type=int, default=3, help="alternative configs tried per shape and M")
    args = parser.parse_args()
    t0 = time.perf_counter()
    shapes = {name: SHAPES[name][:2] for name in args.shapes.split(",")}
    rows = bench_all(shapes, [int(m) for m in args.batches.split(",")],
                     lambda name, m, weights: bench_shape(name, m, weights, args.alts),
                     lambda r: f"cublas {r['cublas_us']:.2f} us, gemv {r['gemv_us']:.2f} us")
    print_table(rows)
    write_json(args.out, {"device": torch.cuda.get_device_name(), "calls_per_graph": CALLS, "rows": rows})
    print(f"wrote {args.out} in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
