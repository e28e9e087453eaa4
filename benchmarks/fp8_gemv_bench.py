"""FP8 skinny matmuls against bf16 on the Llama-3.1-8B's decode layers (issue #34: bs1 FP8 >= 1.6x bf16).

    python3 -m benchmarks.fp8_gemv_bench --out fp8_gemv.json          # a CUDA GPU, ~1 minute with compiles
    python3 -m benchmarks.fp8_gemv_bench --no-sweep --out quick.json   # the defaults only

Per layer (qkv 4096->6144, o 4096->4096, gate_up 4096->28672, down 14336->4096) and rows M in {1, 4, 16}:

    bf16 cublas    F.linear
    bf16 engine    what layers/skinny.py runs for a bf16 weight of this shape at M rows: the CUDA C++ gemv
                   (kernels/cuda/cuda_gemv.py) where cuda_skinny("auto") takes it, else the Triton gemv where
                   skinny_policy says it wins, else cuBLAS (the plain matmul road; the engine folds the norm /
                   SiLU-mul into the same kernels)
    fp8 row        kernels/triton/gemv.py with w_scale= (per-channel scales), its default config
    fp8 block128   kernels/triton/fp8_gemv.py with 128 x 128 tile scales, its default config
    fp8 row via fp8_gemv   (M=1) row scales through fp8_gemv.py instead: whether layers/fp8.py should route there
    sweep          (M=1 and M=16 by default) a few candidate configs of both FP8 kernels around their defaults

Times: a CUDA graph of ITERS launches, each on another copy of the weight (the copies together exceed twice the
L2, so every launch reads HBM as in a decode step), replayed REPEATS times; the median replay / ITERS. GB/s is
the weight's bytes (and its scales) over that time. The JSON at --out holds every timing, the best config per
shape, and the speedups of the FP8 defaults over the bf16 engine road.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import statistics
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F

from benchmarks import write_json

LAYERS = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}   # (K, N)
ROWS = (1, 4, 16)
SWEEP_ROWS = (1, 16)
BLOCK = (128, 128)
ITERS = 20
REPEATS = 7
DEVICE = "cuda"            # a module constant so a CPU dry run (the interpreter, time_us stubbed) can swap it
ROTATE_BYTES = 256 << 20   # the weight copies a graph cycles through: > 2x the 50 MB L2 of an H100


# ---------------------------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------------------------


def time_us(calls: list[Callable[[], object]], iters: int = ITERS, repeats: int = REPEATS) -> float:
    """Median microseconds a call, the calls cycled ITERS times inside a CUDA graph (a plain loop if capture
    fails: the launch gaps then count too)."""
    for call in calls:   # compiles, caches, allocator warm-up: outside the capture
        call()
    torch.cuda.synchronize()
    run: Callable[[], None]
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(iters):
                calls[i % len(calls)]()
        run = graph.replay
    except RuntimeError as error:   # pragma: no cover - a kernel that cannot be captured
        print(f"  (graph capture failed, plain loop: {error})", file=sys.stderr)

        def run() -> None:
            for i in range(iters):
                calls[i % len(calls)]()
    run()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / iters)
    return statistics.median(times)


# ---------------------------------------------------------------------------------------------------------------
# operands and roads
# ---------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Weights:
    """Copies of one layer's weight in the three layouts; x is shared (kilobytes, as in decode)."""
    bf16: list[torch.Tensor]
    fp8: list[torch.Tensor]
    row_scale: list[torch.Tensor]
    block_scale: list[torch.Tensor]


def make_weights(k: int, n: int, seed: int = 0) -> Weights:
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    copies = lambda nbytes: max(2, -(-ROTATE_BYTES // nbytes))   # noqa: E731
    bf16 = [(torch.randn(n, k, device=DEVICE, generator=g) * 0.02).to(torch.bfloat16)
            for _ in range(copies(2 * n * k))]
    fp8 = [(torch.randn(n, k, device=DEVICE, generator=g) * 8).clamp(-448, 448).to(torch.float8_e4m3fn)
           for _ in range(copies(n * k))]
    row = [torch.rand(n, 1, device=DEVICE, generator=g) * 1e-3 + 1e-4 for _ in fp8]
    blocks = [torch.rand(-(-n // BLOCK[0]), -(-k // BLOCK[1]), device=DEVICE, generator=g) * 1e-3 + 1e-4
              for _ in fp8]
    return Weights(bf16, fp8, row, blocks)


def engine_bf16_road(x: torch.Tensor, w: torch.Tensor) -> tuple[str, Callable[..., torch.Tensor]]:
    """(name, fn(x, w)) of the matmul layers/skinny.py's default method runs for this bf16 weight at x's rows."""
    from kestrel.kernels.triton import gemv
    from kestrel.layers.skinny import skinny_policy

    try:
        from kestrel.layers.skinny import cuda_skinny
        cuda = cuda_skinny("auto")
    except Exception as error:   # noqa: BLE001 - no NVRTC here: the engine would fall back the same way
        print(f"  (CUDA C++ gemv unavailable: {error})", file=sys.stderr)
        cuda = None
    if cuda is not None and cuda.use(x, w, False):
        return "cuda_gemv", lambda x, w: cuda.gemv(x, w)
    if skinny_policy(x.shape[0], *w.shape):
        return "triton_gemv", lambda x, w: gemv.gemv(x, w)
    return "cublas", lambda x, w: F.linear(x, w)


def fp8_block_candidates(m: int, n: int, k: int) -> list:
    """fp8_gemv.py configs around the table's: split-K halved / doubled, 256 / 1024-byte steps, 8 warps, the
    other loop form."""
    from kestrel.kernels.triton.fp8_gemv import split_plan, table_config

    base = table_config(m, n, k)
    steps = -(-k // base.block_k)
    out = [base,
           dataclasses.replace(base, split_k=base.split_k * 2),
           dataclasses.replace(base, split_k=max(1, base.split_k // 2)),
           dataclasses.replace(base, num_warps=8),
           dataclasses.replace(base, block_k=1024, split_k=max(1, base.split_k // 2) if steps > 2 else 1),
           dataclasses.replace(base, block_k=256, split_k=base.split_k),
           dataclasses.replace(base, unroll=not base.unroll)]
    seen, unique = set(), []
    for cfg in out:   # a config whose plan and code match another's is the same kernel
        plan = (split_plan(k, cfg), cfg.block_k, cfg.num_warps, cfg.unroll, cfg.block_n, cfg.use_dot)
        if plan not in seen:
            seen.add(plan)
            unique.append(cfg)
    return unique


def fp8_row_candidates(m: int, n: int, k: int) -> list:
    """gemv.py configs for FP8 weights: the table's (element_size 1), the bf16 table's (same elements, half the
    bytes), half the rows a program, 4 warps."""
    from kestrel.kernels.triton import gemv

    base = gemv.table_config(m, n, k, whole_slice=m <= gemv.BROADCAST_MAX_M, element_size=1)
    out = [base, gemv.table_config(m, n, k, whole_slice=m <= gemv.BROADCAST_MAX_M),
           dataclasses.replace(base, num_warps=4 if base.num_warps == 8 else 8)]
    if base.block_n >= (16 if base.use_dot else 8):
        out.append(dataclasses.replace(base, block_n=base.block_n // 2))
    return list(dict.fromkeys(out))


def describe(cfg) -> str:
    fields = dataclasses.asdict(cfg)
    return ",".join(f"{key}={value}" for key, value in fields.items())


# ---------------------------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------------------------


def bench_defaults(name: str, ws: Weights, m: int) -> dict:
    """The four roads' defaults for one layer at m rows, and the FP8 defaults' errors against the reference."""
    from kestrel.kernels.triton import gemv
    from kestrel.kernels.triton.fp8_gemv import default_config, fp8_gemv, fp8_gemv_ref

    n, k = ws.fp8[0].shape
    x = torch.randn(m, k, device=DEVICE).to(torch.bfloat16)
    road, engine = engine_bf16_road(x, ws.bf16[0])
    rec = {"layer": name, "K": k, "N": n, "M": m, "engine_bf16_road": road, "timings": [], "x": x}
    add(rec, "bf16_cublas", time_us([lambda w=w: F.linear(x, w) for w in ws.bf16]), 2 * n * k)
    add(rec, "bf16_engine", time_us([lambda w=w: engine(x, w) for w in ws.bf16]), 2 * n * k)
    add(rec, "fp8_row", time_us([lambda w=w, s=s: gemv.gemv(x, w, w_scale=s) for w, s in zip(ws.fp8, ws.row_scale)]),
        row_bytes(ws), describe(gemv.default_config(m, n, k, 1)))
    add(rec, "fp8_block128", time_us([lambda w=w, s=s: fp8_gemv(x, w, s, BLOCK)
                                      for w, s in zip(ws.fp8, ws.block_scale)]),
        block_bytes(ws), describe(default_config(m, n, k)))
    if m == 1:   # row scales through fp8_gemv.py's split-K grid instead (what layers/fp8.py could route there)
        add(rec, "fp8_row_via_fp8_gemv", time_us([lambda w=w, s=s: fp8_gemv(x, w, s)
                                                  for w, s in zip(ws.fp8, ws.row_scale)]),
            row_bytes(ws), describe(default_config(m, n, k)))
    ref = fp8_gemv_ref(x, ws.fp8[0], ws.block_scale[0], BLOCK).float()
    got = fp8_gemv(x, ws.fp8[0], ws.block_scale[0], BLOCK).float()
    rec["fp8_block128_max_rel_err"] = ((got - ref).abs().max() / ref.abs().max()).item()
    ref = fp8_gemv_ref(x, ws.fp8[0], ws.row_scale[0]).float()
    got = gemv.gemv(x, ws.fp8[0], w_scale=ws.row_scale[0]).float()
    rec["fp8_row_max_rel_err"] = ((got - ref).abs().max() / ref.abs().max()).item()
    return rec


def sweep_jobs(rec: dict, ws: Weights) -> list[tuple]:
    """(rec, road, config, bytes, calls) for the candidates of both FP8 kernels at rec's shape but their defaults
    (bench_defaults timed those), the two kernels' lists interleaved."""
    from kestrel.kernels.triton import gemv
    from kestrel.kernels.triton.fp8_gemv import fp8_gemv

    x, m, n, k = rec["x"], rec["M"], rec["N"], rec["K"]
    block = [(rec, "sweep_fp8_block128", cfg, block_bytes(ws),
              [lambda w=w, s=s, c=cfg: fp8_gemv(x, w, s, BLOCK, config=c) for w, s in zip(ws.fp8, ws.block_scale)])
             for cfg in fp8_block_candidates(m, n, k)[1:]]   # [0]: the default, timed already
    row = [(rec, "sweep_fp8_row", cfg, row_bytes(ws),
            [lambda w=w, s=s, c=cfg: gemv.gemv(x, w, config=c, w_scale=s) for w, s in zip(ws.fp8, ws.row_scale)])
           for cfg in fp8_row_candidates(m, n, k)[1:]]
    return interleave([block, row])


def interleave(lists: list[list]) -> list:
    return [item for group in itertools.zip_longest(*lists) for item in group if item is not None]


def run_sweep(jobs: list[tuple], deadline: float) -> None:
    """Time the jobs in order until the deadline (compiles dominate); a candidate that fails is reported."""
    for rec, label, cfg, nbytes, calls in jobs:
        if time.monotonic() > deadline:
            rec["sweep_cut"] = True
            continue
        try:
            add(rec, label, time_us(calls), nbytes, describe(cfg))
        except Exception as error:   # noqa: BLE001 - a candidate that does not compile (registers, shared memory)
            print(f"  {rec['layer']} M={rec['M']} {label} [{describe(cfg)}] failed: {error}", file=sys.stderr)


def add(rec: dict, road: str, us: float, nbytes: int, config: str | None = None) -> None:
    rec["timings"].append({"road": road, "us": us, "gbps": nbytes / us / 1e3, "config": config})


def row_bytes(ws: Weights) -> int:
    return ws.fp8[0].numel() + ws.row_scale[0].numel() * 4


def block_bytes(ws: Weights) -> int:
    return ws.fp8[0].numel() + ws.block_scale[0].numel() * 4


def summarize(rec: dict) -> None:
    by_road = {t["road"]: t["us"] for t in rec["timings"] if not t["road"].startswith("sweep")}
    bf16 = by_road["bf16_engine"]
    fp8 = [road for road in by_road if road.startswith("fp8")]
    rec["speedup_vs_bf16_engine"] = {road: bf16 / by_road[road] for road in fp8}
    rec["speedup_vs_bf16_cublas"] = {road: by_road["bf16_cublas"] / by_road[road] for road in fp8}
    for kind in ("fp8_block128", "fp8_row"):   # the default config is a candidate too
        sweep = [t for t in rec["timings"] if t["road"] == f"sweep_{kind}"]
        if sweep:
            best = min(sweep + [t for t in rec["timings"] if t["road"] == kind], key=lambda t: t["us"])
            rec[f"best_{kind}"] = {"us": best["us"], "gbps": best["gbps"], "config": best["config"]}


def print_row(rec: dict, sweep_only: bool = False) -> None:
    if not sweep_only:
        print_defaults(rec)
    for kind in ("fp8_block128", "fp8_row"):
        best = rec.get(f"best_{kind}")
        if best:
            print(f"{rec['layer']:8s} M={rec['M']:2d}  best {kind}: {best['us']:.1f} us {best['gbps']:.0f} GB/s  "
                  f"[{best['config']}]", flush=True)


def print_defaults(rec: dict) -> None:
    summarize(rec)
    t = {x["road"]: x for x in rec["timings"] if not x["road"].startswith("sweep")}
    cells = "  ".join(f"{road} {t[road]['us']:7.1f} us {t[road]['gbps']:5.0f} GB/s"
                      for road in ("bf16_cublas", "bf16_engine", "fp8_row", "fp8_block128", "fp8_row_via_fp8_gemv")
                      if road in t)
    sp = rec["speedup_vs_bf16_engine"]
    print(f"{rec['layer']:8s} M={rec['M']:2d}  {cells}  (engine bf16: {rec['engine_bf16_road']}; fp8/bf16 engine "
          f"row {sp['fp8_row']:.2f}x block {sp['fp8_block128']:.2f}x)", flush=True)


def step_totals(rows: list[dict]) -> dict:
    """The four matmuls of one layer per M, summed per road: the decode step's share of it."""
    totals: dict = {}
    for rec in rows:
        for t in rec["timings"]:
            if not t["road"].startswith("sweep"):
                totals.setdefault(rec["M"], {}).setdefault(t["road"], 0.0)
                totals[rec["M"]][t["road"]] += t["us"]
    return totals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="JSON results path")
    parser.add_argument("--no-sweep", action="store_true", help="the default configs only")
    parser.add_argument("--budget-s", type=float, default=55.0,
                        help="no new sweep candidate after this many seconds from the start (compiles included)")
    parser.add_argument("--layers", default=",".join(LAYERS), help="comma-separated subset of " + ",".join(LAYERS))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    started = time.monotonic()
    names = args.layers.split(",")
    weights = {name: make_weights(*LAYERS[name]) for name in names}
    rows = []
    for name in names:   # the defaults first: the table and the speedups are what the sweep may cut short of
        for m in ROWS:
            rows.append(bench_defaults(name, weights[name], m))
            print_row(rows[-1])
    if not args.no_sweep:
        deadline = started + args.budget_s
        for m in SWEEP_ROWS:   # bs1 first (the issue's figure), the layers' candidates round-robin
            recs = [r for r in rows if r["M"] == m]
            run_sweep(interleave([sweep_jobs(r, weights[r["layer"]]) for r in recs]), deadline)
            for rec in recs:
                summarize(rec)
                print_row(rec, sweep_only=True)
    for rec in rows:
        summarize(rec)
        del rec["x"]
    totals = step_totals(rows)
    for m, roads in totals.items():
        bf16 = roads["bf16_engine"]
        print(f"layer total M={m}: " + "  ".join(f"{road} {us:.1f} us" for road, us in roads.items())
              + f"  -> fp8 row {bf16 / roads['fp8_row']:.2f}x, fp8 block128 {bf16 / roads['fp8_block128']:.2f}x "
              "the bf16 engine road")
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": __import__("triton").__version__, "iters": ITERS, "repeats": REPEATS,
              "seconds": time.monotonic() - started, "layers": rows, "layer_totals_us": totals}
    write_json(args.out, result)
    print(f"{time.monotonic() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
