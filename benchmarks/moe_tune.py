"""Tune the fused MoE tiles path per batch bucket on this GPU and write the table the engine reads (issue 51: MoE at
batch, configs chosen per shape and batch bucket, stored as data the way vLLM ships its per-(E, N, device) files).

    python3 -m benchmarks.moe_tune --shape qwen3-30b-a3b --out-dir kestrel/kernels/triton/moe_configs \
        --json tune.json

For each token count T (the decode graph buckets and prefill chunk sizes where the tiles path runs: T k > 64
rows), random top-k routing over E experts (uniform: every expert gets ~T k / E rows, as a trained router's load
balancing aims for), one layer's experts at the shape's sizes. Candidates by coordinate descent from the untuned
default: the row tile with gate|up's tiles, then down's tiles, then warps and stages; each timed as the whole
fused_experts_triton call (alignment, both kernels, the slot sum) in a CUDA graph. The best per T goes into
moe_configs/E=..,N=..,H=..,k=..,device=<this GPU>.json; --json keeps every timing and the speedups over the
default.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

from benchmarks.fp8_gemv_bench import time_us
from benchmarks.shapes import SHAPES

TOKENS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def experts(shape: dict) -> int:
    return shape.get("num_experts") or shape.get("n_routed_experts") or 0


def problem(tokens: int, experts: int, topk: int, hidden: int, inter: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(tokens, hidden, device="cuda", generator=g)).to(torch.bfloat16)
    w13 = (torch.randn(experts, 2 * inter, hidden, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    w2 = (torch.randn(experts, hidden, inter, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    ids = torch.rand(tokens, experts, device="cuda", generator=g).argsort(dim=1)[:, :topk].to(torch.int32)
    weights = torch.softmax(torch.randn(tokens, topk, device="cuda", generator=g), dim=1)
    return x, w13, w2, ids, weights


def steps(base):
    """Coordinate-descent rounds: each a list of variants of the round's starting point."""
    yield [dataclasses.replace(base, block_m=m, block_n=n, block_k=k)
           for m in (16, 32, 64) for n in (32, 64, 128) for k in (64, 128)]
    yield lambda best: [dataclasses.replace(best, down_block_n=n, down_block_k=k)
                        for n in (32, 64, 128) for k in (64, 128)]
    yield lambda best: [dataclasses.replace(best, num_warps=w, num_stages=st) for w in (4, 8) for st in (2, 3, 4)]


def tune(tokens: int, shape: dict, deadline: float) -> dict:
    from kestrel.kernels.triton.fused_moe import DEFAULT_TILES, fused_experts_triton

    e, k, h, i = experts(shape), shape["num_experts_per_tok"], shape["hidden_size"], shape["moe_intermediate_size"]
    x, w13, w2, ids, weights = problem(tokens, e, k, h, i)
    want = fused_experts_triton(x, w13, w2, ids, weights, path="tiles", tiles=DEFAULT_TILES).float()

    def timed(cfg) -> float | None:
        try:
            got = fused_experts_triton(x, w13, w2, ids, weights, path="tiles", tiles=cfg).float()
            if ((got - want).norm() / want.norm()).item() > 1e-2:
                print(f"  T={tokens} {cfg}: wrong result", file=sys.stderr)
                return None
            return time_us([lambda: fused_experts_triton(x, w13, w2, ids, weights, path="tiles", tiles=cfg)],
                           iters=10, repeats=5)
        except Exception as error:   # noqa: BLE001 - shared memory / registers
            print(f"  T={tokens} {cfg}: {str(error)[:100]}", file=sys.stderr)
            return None

    default_us = timed(DEFAULT_TILES)
    best, best_us, tried = DEFAULT_TILES, default_us, []
    for round_ in steps(DEFAULT_TILES):
        candidates = round_ if isinstance(round_, list) else round_(best)
        for cfg in candidates:
            if time.monotonic() > deadline:
                break
            us = timed(cfg)
            tried.append({"tiles": dataclasses.asdict(cfg), "us": us})
            if us is not None and us < best_us:
                best, best_us = cfg, us
    print(f"T={tokens:5d}: default {default_us:8.1f} us, best {best_us:8.1f} us ({default_us / best_us:.2f}x) "
          f"{dataclasses.asdict(best)}", flush=True)
    return {"tokens": tokens, "default_us": default_us, "best_us": best_us, "best": dataclasses.asdict(best),
            "tried": tried}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen3-30b-a3b", choices=[n for n, c in SHAPES.items() if experts(c)])
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--budget-s", type=float, default=240.0)
    ap.add_argument("--out-dir", default=None, help="where the table goes (kestrel/kernels/triton/moe_configs)")
    ap.add_argument("--json", default=None, help="every timing")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    from kestrel.kernels.triton.fused_moe import config_file_name

    shape = SHAPES[args.shape]
    token_counts = [int(t) for t in args.tokens.split(",")]
    start = time.monotonic()
    results = []
    for n, tokens in enumerate(token_counts):   # an even share of what is left for each bucket
        share = (args.budget_s - (time.monotonic() - start)) / (len(token_counts) - n)
        results.append(tune(tokens, shape, time.monotonic() + share))
    name = config_file_name(experts(shape), shape["moe_intermediate_size"], shape["hidden_size"],
                            shape["num_experts_per_tok"], torch.cuda.get_device_name())
    table = {"device": torch.cuda.get_device_name(), "shape": args.shape, "dtype": "bfloat16",
             "tuned": time.strftime("%Y-%m-%d"), "by": "benchmarks/moe_tune.py",
             "configs": {str(r["tokens"]): r["best"] for r in results}}
    if args.out_dir:
        Path(args.out_dir).mkdir(parents=True, exist_ok=True)
        (Path(args.out_dir) / name).write_text(json.dumps(table, indent=1) + "\n")
        print(f"wrote {Path(args.out_dir) / name}")
    if args.json:
        Path(args.json).write_text(json.dumps({"table": table, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
