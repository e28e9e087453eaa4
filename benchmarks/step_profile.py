"""Where a batched decode step's time goes: B sequences decoding together, a few engine steps under torch.profiler.

    python -m benchmarks.step_profile --shape llama-3.1-8b --batch 128 --out step_profile.json
    python -m benchmarks.step_profile --shape qwen3-0.6b --batch 8 --device cpu --steps 2 --out /tmp/p.json  # CPU
    python -m benchmarks.step_profile --shape qwen3-30b-a3b --fp8-block --fp8-moe w8a8 --out p.json  # W8A8 experts

Weights are random, made on the device (`--load-format dummy` from config.json alone). B fresh prompts of
--prompt-len tokens are prefilled first (not profiled); then every sequence decodes and --steps engine steps run
under the profiler. Reported per step:

    wall_ms             host clock from the first profiled step's start to the last's end, synchronized, / steps
    device_busy_ms      the sum of kernel and copy times (their overlap ignored: kernels of one stream do not overlap)
    host_gap_ms         wall - device busy: what the GPU spends waiting for the host (scheduling, launches, output)
    by_category_ms      kernels grouped by name (gemm, attention, norm/rope/act, sampling, moe, copy, other)
    gemm_roofline       the linear layers' FLOPs and weight bytes at M = B against the card's measured rates:
                        the floor a step's GEMMs cannot beat, and the fraction of it reached
    top                 the kernels by device time
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

import torch

from benchmarks.shapes import SHAPES, write_config_only
from kestrel.envs import switches

# name pattern -> category; first match wins (cuBLAS / CUTLASS GEMMs carry gemm, xmma, nvjet or cutlass)
CATEGORIES = [
    ("moe", r"moe|expert|fused_experts|align_block"),
    ("gemm", r"gemm|xmma|nvjet|cutlass|gemv|matmul|splitk|sm90_|_mm_"),
    ("attention", r"attention|attend|paged|flash|decode_kernel|cluster_decode|latent"),
    ("sampling", r"argmax|sample|softmax|topk|top_k|multinomial|logits"),
    ("norm/rope/act", r"rms|norm|rotary|rope|silu|act_and_mul|prologue"),
    ("copy", r"memcpy|memset|copy|fill|cat|index"),
]


def category(name: str) -> str:
    lower = name.lower()
    for label, pattern in CATEGORIES:
        if re.search(pattern, lower):
            return label
    return "other"


def linear_cost(cfg: dict, batch: int, bytes_per_weight: float = 2.0) -> tuple[float, float]:
    """(FLOPs, weight bytes) of one decode step's linear layers at M = batch (dense shapes; the MoE shapes' experts
    count every expert, an upper bound on bytes)."""
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or h // heads
    inter = cfg.get("moe_intermediate_size") if cfg.get("num_experts") else cfg["intermediate_size"]
    experts = cfg.get("num_experts", 1)
    attn = h * (heads + 2 * kv) * d + heads * d * h
    mlp = experts * 3 * h * inter
    weights = layers * (attn + mlp) + h * cfg["vocab_size"]
    active = layers * (attn + (cfg.get("num_experts_per_tok", 1) * 3 * h * inter if cfg.get("num_experts")
                               else mlp)) + h * cfg["vocab_size"]
    return 2.0 * active * batch, weights * bytes_per_weight


def measured_rates(device: str) -> tuple[float, float]:
    """(bf16 matmul FLOP/s, copy bytes/s counting read + written) measured here, the two ceilings."""
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    src = torch.randn(1 << 28, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)

    def timed(fn, n: int) -> float:
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n

    flops = 2 * 8192 ** 3 / timed(lambda: a @ b, 10)
    copy = 2 * src.numel() * src.element_size() / timed(lambda: dst.copy_(src), 10)
    del a, b, src, dst
    torch.cuda.empty_cache()
    return flops, copy


def timed_events(prof, cuda: bool) -> list[tuple[float, int, str]]:
    """A finished torch.profiler run's (microseconds, calls, name) by total time, largest first: kernels by device
    time on CUDA, ops by self CPU time on the CPU."""
    events = []
    for e in prof.key_averages():
        us = (getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)) if cuda \
            else e.self_cpu_time_total
        if us > 0:
            events.append((us, e.count, e.key))
    return sorted(events, reverse=True)


def profile_steps(engine, steps: int, cuda: bool, top: int = 30) -> dict:
    from torch.profiler import ProfilerActivity, profile

    if cuda:
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    events = timed_events(prof, cuda)
    by_cat: dict[str, float] = {}
    for us, _, name in events:
        by_cat[category(name)] = by_cat.get(category(name), 0.0) + us / steps / 1e3
    busy = sum(us for us, _, _ in events) / steps / 1e3
    return {"steps": steps, "clock": "device" if cuda else "self cpu (the CPU road: ops, not kernels)",
            "wall_ms": 1e3 * wall / steps, "device_busy_ms": busy, "host_gap_ms": 1e3 * wall / steps - busy,
            "launches_per_step": sum(n for _, n, _ in events) / steps,
            "by_category_ms": dict(sorted(by_cat.items(), key=lambda kv: -kv[1])),
            "top": [{"ms_per_step": us / steps / 1e3, "calls_per_step": n / steps, "category": category(name),
                     "name": name[:140]} for us, n, name in events[:top]]}


def with_fp8_block_config(model_dir: Path) -> Path:
    """A copy of model_dir whose config.json declares HF FP8 with 128 x 128 weight tiles (dummy weights then load
    as FP8 with tile scales)."""
    import shutil

    dst = model_dir.with_name(model_dir.name + "-fp8-block")
    shutil.copytree(model_dir, dst, dirs_exist_ok=True)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128]}
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    return dst


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--workdir", default="/tmp/kestrel-bench")
    ap.add_argument("--fp8-block", action="store_true", help="the shape as an HF FP8 checkpoint with 128 x 128 "
                    "weight tiles (dummy FP8 weights, MoE experts included; activations dynamic), as vLLM's peer "
                    "recipe serves it")
    ap.add_argument("--fp8-moe", choices=("w8a16", "w8a8"), default=None,
                    help="block-FP8 experts' kernels: sets KESTREL_FP8_MOE for this run (default: the environment's, "
                    "else w8a16); the report records the one the engine read")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.fp8_moe:   # before the engine reads its switches (once, at construction)
        os.environ["KESTREL_FP8_MOE"] = args.fp8_moe
        switches.cache_clear()
    from kestrel.bench.fresh import FreshPrompts, cache_counters, hit_rate_fields
    from kestrel.config import EngineConfig
    from kestrel.engine.engine import Engine
    from kestrel.sampling_params import SamplingParams

    cuda = args.device.startswith("cuda")
    cfg = SHAPES[args.shape]
    model_dir = write_config_only(args.shape, Path(args.workdir) / f"{args.shape}-dummy")
    if args.fp8_block:
        model_dir = with_fp8_block_config(model_dir)
    report: dict = {"fp8_block": args.fp8_block, "fp8_moe": switches().fp8_moe, "shape": args.shape, "batch": args.batch, "prompt_len": args.prompt_len, "device": args.device,
                    "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    if cuda:
        report["gpu"] = torch.cuda.get_device_name()
        flops, copy = measured_rates(args.device)
        report["measured"] = {"bf16_matmul_tflop_s": flops / 1e12, "copy_gb_s": copy / 1e9}
    engine = Engine(EngineConfig(model=str(model_dir), device=args.device, load_format="dummy",
                                 max_num_seqs=max(256, args.batch)))
    # Warm-up on prompts of its own: no profiled prompt shares a cached block with anything sent before.
    fresh = FreshPrompts(cfg["vocab_size"])
    params = SamplingParams(max_tokens=args.steps + 64, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(fresh.take(args.batch, args.prompt_len)):
        engine.add_request(f"warm{i}", p, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    before = cache_counters(engine)
    for i, p in enumerate(fresh.take(args.batch, args.prompt_len)):
        engine.add_request(f"p{i}", p, params)
    while any(not s.output_token_ids for seqs in engine.requests.values() for s in seqs):   # every prompt prefilled
        engine.step()
    for _ in range(4):   # a few plain decode steps at the full batch before the profiled ones
        engine.step()
    report.update(hit_rate_fields(before, cache_counters(engine)))
    report["running"] = len(engine.scheduler.running)
    report["profile"] = profile_steps(engine, args.steps, cuda)
    flops, weight_bytes = linear_cost(cfg, report["running"])
    report["gemm_roofline"] = {"flops_per_step": flops, "weight_bytes_per_step": weight_bytes}
    if cuda:
        m = report["measured"]
        floor_ms = 1e3 * max(flops / (m["bf16_matmul_tflop_s"] * 1e12), weight_bytes / (m["copy_gb_s"] * 1e9))
        gemm_ms = report["profile"]["by_category_ms"].get("gemm", 0.0)
        report["gemm_roofline"].update(floor_ms=floor_ms, measured_gemm_ms=gemm_ms,
                                       fraction_reached=floor_ms / gemm_ms if gemm_ms else None)
    while engine.has_unfinished():
        engine.step()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    p = report["profile"]
    print(f"{args.shape} batch {report['running']}: wall {p['wall_ms']:.2f} ms/step, device busy "
          f"{p['device_busy_ms']:.2f}, host gap {p['host_gap_ms']:.2f}; " +
          ", ".join(f"{k} {v:.2f}" for k, v in p["by_category_ms"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
