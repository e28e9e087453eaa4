"""The first burst after ready against the next one (issue 51: first burst >= 0.97x warm), in one engine, with the
Triton kernels built in between listed (kernels/compile_watch.py).

    python3 -m benchmarks.first_burst --shape llama-3.1-8b --out fb.json [--fp8-block] [--temperature 1.0]

Each burst: CONCURRENCY fresh prompts (kestrel/bench/fresh.py: no prompt shares a cached block with another or
with an earlier burst) of PROMPT_LEN random tokens, OUTPUT_LEN tokens each (ignore_eos), all added at once, the
engine stepped until done; output tokens / wall seconds. Dummy weights in the shape's real sizes.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from benchmarks.shapes import SHAPES, write_config_only
from benchmarks.step_profile import with_fp8_block_config


def burst(engine, prompts: list[list[int]], params, tag: str) -> dict:
    from kestrel.bench.fresh import cache_counters, hit_rate_fields

    before, built_before = cache_counters(engine), len(engine.compile_watch.after_ready())
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}{i}", p, params)
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    built = engine.compile_watch.after_ready()[built_before:]
    return {"wall_s": wall, "steps": steps, "output_tok_s": len(prompts) * params.max_tokens / wall,
            "kernel_builds": [f"{b.kernel} {b.signature[:300]}" for b in built],
            **hit_rate_fields(before, cache_counters(engine))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=1.0, help="kestrel bench serve's default (sampled rows)")
    ap.add_argument("--bursts", type=int, default=3)
    ap.add_argument("--fp8-block", action="store_true", help="HF FP8 with 128 x 128 tiles (dummy FP8 weights)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--workdir", default="/tmp/kestrel-bench")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    from kestrel.bench.fresh import FreshPrompts
    from kestrel.config import EngineConfig
    from kestrel.engine.engine import Engine
    from kestrel.sampling_params import SamplingParams

    model_dir = write_config_only(args.shape, Path(args.workdir) / f"{args.shape}-dummy")
    if args.fp8_block:
        model_dir = with_fp8_block_config(model_dir)
    t0 = time.perf_counter()
    engine = Engine(EngineConfig(model=str(model_dir), device=args.device, load_format="dummy",
                                 max_num_seqs=max(256, args.concurrency)))
    report: dict = {"shape": args.shape, "fp8_block": args.fp8_block, "concurrency": args.concurrency,
                    "prompt_len": args.prompt_len, "output_len": args.output_len, "temperature": args.temperature,
                    "startup_s": time.perf_counter() - t0, "torch": torch.__version__,
                    "date": time.strftime("%Y-%m-%d"),
                    "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None}
    fresh = FreshPrompts(SHAPES[args.shape]["vocab_size"])
    params = SamplingParams(max_tokens=args.output_len, temperature=args.temperature, ignore_eos=True)
    report["bursts"] = [burst(engine, fresh.take(args.concurrency, args.prompt_len), params, f"b{i}-")
                        for i in range(args.bursts)]
    first, warm = report["bursts"][0]["output_tok_s"], max(b["output_tok_s"] for b in report["bursts"][1:])
    report["first_over_warm"] = first / warm
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"{args.shape}{' fp8-block' if args.fp8_block else ''} c{args.concurrency}: startup "
          f"{report['startup_s']:.1f} s; bursts " + ", ".join(f"{b['output_tok_s']:.0f}" for b in report["bursts"])
          + f" tok/s; first/warm {report['first_over_warm']:.3f}; kernels built in the first burst: "
          f"{len(report['bursts'][0]['kernel_builds'])}")
    for line in report["bursts"][0]["kernel_builds"]:
        print("  built:", line)
    engine.shutdown() if hasattr(engine, "shutdown") else None
    return 0


if __name__ == "__main__":
    sys.exit(main())
