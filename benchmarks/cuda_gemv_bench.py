"""The CUDA C++ skinny matmuls (kestrel/layers/cuda_gemv.py) against cuBLAS at the Llama-3.1-8B's layer shapes.

For M in {1, 4} and each layer, inside CUDA graphs of back-to-back calls that cycle through > 200 MB of weight
copies (every call reads HBM; gemv_bench.py's method):
  cublas     F.linear(x, w)
  unfused    what the layer runs today: qkv / gate_up: fused_ops.rms_norm + F.linear (gate_up: + silu_and_mul)
  cuda       cuda_gemv with its default config, then each alternative row split and step width
  fused      the CUDA kernel with its fold: add_rms_norm_gemv (qkv), add_rms_norm_gemv_silu (gate_up)
TB/s counts weight bytes only. Prints a markdown table, writes JSON (--out).

    python -m benchmarks.cuda_gemv_bench --out /tmp/cuda_gemv.json
"""
from __future__ import annotations

import argparse
import dataclasses
import time

import torch
import torch.nn.functional as F

from benchmarks import write_json
from benchmarks.gemv_bench import EPS, bench_all, graph_time_us
from kestrel.layers import cuda_gemv, fused_ops

SHAPES = {  # name: (K, weight rows, fold)
    "8b.qkv": (4096, 6144, "norm"), "8b.o": (4096, 4096, None),
    "8b.gate_up": (4096, 28672, "norm_silu"), "8b.down": (14336, 4096, None),
}


def alternatives(n: int, k: int, silu: bool, m: int) -> list[cuda_gemv.CudaGemvConfig]:
    halves = 2 if silu else 1
    m_tile = 1 if m == 1 else 2 if m == 2 else 4
    out = [cuda_gemv.default_config(n, k, silu, torch.cuda.get_device_properties(0).multi_processor_count, m_tile)]
    for rows in (1, 2, 3, 4):
        for loads in (8, 16):
            if rows * halves > loads:
                continue
            u = max(d for d in range(1, loads // (rows * halves) + 1) if (k // 256) % d == 0)
            cfg = cuda_gemv.CudaGemvConfig(rows=rows, u=u)
            if cfg not in out:
                out.append(cfg)
    return out


def bench(name: str, m: int, weights: list[torch.Tensor]) -> dict:
    k, rows, fold = SHAPES[name]
    dev = weights[0].device
    gen = torch.Generator(device=dev).manual_seed(m)
    x = torch.randn(m, k, generator=gen, device=dev).to(torch.bfloat16)
    residual = torch.randn(m, k, generator=gen, device=dev).to(torch.bfloat16)
    norm_w = (1 + 0.1 * torch.randn(k, generator=gen, device=dev)).to(torch.bfloat16)
    w = lambda i: weights[i % len(weights)]   # noqa: E731
    silu = fold == "norm_silu"
    n = rows // 2 if silu else rows
    row = {"shape": name, "M": m, "K": k, "rows": rows, "weight_mb": rows * k * 2 / 1e6}
    row["cublas_us"] = graph_time_us(lambda i: F.linear(x, w(i)))
    if fold == "norm":
        row["unfused_us"] = graph_time_us(lambda i: F.linear(fused_ops.rms_norm(x, norm_w, EPS, residual)[0], w(i)))
        row["fused_us"] = graph_time_us(lambda i: cuda_gemv.add_rms_norm_gemv(x, residual, norm_w, EPS, w(i)))
    elif silu:
        row["unfused_us"] = graph_time_us(lambda i: fused_ops.silu_and_mul(
            F.linear(fused_ops.rms_norm(x, norm_w, EPS, residual)[0], w(i))))
        row["fused_us"] = graph_time_us(lambda i: cuda_gemv.add_rms_norm_gemv_silu(x, residual, norm_w, EPS, w(i)))
    tried = {}
    for cfg in alternatives(n, k, silu, m):
        launch = (lambda i, c=cfg: cuda_gemv.add_rms_norm_gemv_silu(x, residual, norm_w, EPS, w(i), config=c)) \
            if silu else (lambda i, c=cfg: cuda_gemv.gemv(x, w(i), config=c))
        tried[f"rows{cfg.rows} u{cfg.u}"] = graph_time_us(launch)
    row["cuda_default_us"] = next(iter(tried.values()))
    row["cuda_best"] = min(tried, key=tried.get)
    row["cuda_best_us"] = tried[row["cuda_best"]]
    row["cuda_all"] = tried
    return row


def print_table(rows: list[dict]) -> None:
    tb = lambda r, key: f"{r[key]:.2f} ({r['weight_mb'] / r[key]:.2f})" if key in r else ""   # noqa: E731
    print("| shape | M | weight MB | cuBLAS us (TB/s) | today's unfused us | CUDA default us (TB/s) "
          "| CUDA best us (TB/s) | best config | CUDA fused us (TB/s) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        unfused = f"{r['unfused_us']:.2f}" if "unfused_us" in r else ""
        print(f"| {r['shape']} | {r['M']} | {r['weight_mb']:.1f} | {tb(r, 'cublas_us')} | {unfused} "
              f"| {tb(r, 'cuda_default_us')} | {tb(r, 'cuda_best_us')} | {r['cuda_best']} | {tb(r, 'fused_us')} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="cuda_gemv_bench.json")
    parser.add_argument("--batches", default="1,4")
    args = parser.parse_args()
    t0 = time.perf_counter()
    rows = bench_all({name: (k, n) for name, (k, n, _) in SHAPES.items()}, [int(m) for m in args.batches.split(",")],
                     bench, lambda r: f"cublas {r['cublas_us']:.2f} us, cuda {r['cuda_default_us']:.2f} "
                                      f"(best {r['cuda_best']} {r['cuda_best_us']:.2f})")
    print_table(rows)
    write_json(args.out, {"device": torch.cuda.get_device_name(), "rows": rows,
                          "configs": {name: dataclasses.asdict(cuda_gemv.default_config(
                              n // 2 if fold == "norm_silu" else n, k, fold == "norm_silu"))
                              for name, (k, n, fold) in SHAPES.items()}})
    print(f"wrote {args.out} in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
