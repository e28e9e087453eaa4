"""Mixture-of-experts decode against its memory roofline (issue #35): one shape, in process, random weights.

    python -m benchmarks.moe_bench --shape qwen3-30b-a3b --out out/qwen3-30b-a3b.json
    python -m benchmarks.moe_bench --shape deepseek-v3-small --out out/deepseek-v3-small.json
    python -m benchmarks.moe_bench --quick --out /tmp/quick.json         # CPU, a tiny config, seconds

The model directory holds config.json and the tokenizer only (benchmarks/shapes.py write_config_only); weights are
made on the device with `LLM(load_format="dummy")`. Measured, in this order (the JSON at --out is rewritten after
each stage, so a timeout keeps what was done):

    copy bandwidth   engine_bench's device-to-device copy (read + written bytes / s), before the engine takes the
                     memory
    bs1              single_stream: prompts one at a time (128 tokens in, --output-len out, greedy, ignore_eos)
                     after a warm-up; decode tok/s excludes the first token (TTFT)
    c128             --concurrency distinct random prompts of 128 tokens submitted at once, --output-len out each,
                     after a warm-up that compiles the batched shapes; output tok/s over the wall time, and
                     decode tok/s after the last request's first token (all of them decoding: the roofline's case)
    kernel profile   --profile-steps bs1 decode steps under torch.profiler: device time by kernel a step
    rooflines        benchmarks/moe_roofline.py: active bytes per token (bs1), experts touched at the batch (c128),
                     KV read at the mean context; and the fraction of each that was reached
    KV bytes/token   the runner's cache layout, next to GQA / MHA of the same width

Every prompt is new (kestrel/bench/fresh.py: no prefix shared with anything sent before, warm-ups included); bs1
and c128 carry their prefix_cache_hit_rate.

The fused Triton MoE is the dev switch KESTREL_FUSED_MOE=1 (kestrel/envs.py; on by default); without
it the CUDA graphs run every expert on every token (layers/moe.py), which the JSON's "experts_impl" shows.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.engine_bench import copy_bandwidth_bytes_per_s, run_requests, single_stream
from benchmarks.moe_roofline import gqa_kv_bytes_per_token, kv_bytes_per_token, moe_bytes, rooflines
from benchmarks.shapes import SHAPES, write_config_only
from kestrel.bench.fresh import FreshPrompts
from kestrel.layers.moe import FusedExperts

QUICK_SHAPE = "qwen3-moe-tiny"


def say(msg: str) -> None:
    print(f"[moe_bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def copy_bandwidth(device: str) -> float:
    """Bytes read + written per second of a large copy on `device` (CUDA: engine_bench's 2 GiB copy)."""
    if device.startswith("cuda"):
        bw = copy_bandwidth_bytes_per_s()
        torch.cuda.empty_cache()   # its 4 GiB back to the driver before the engine sizes its KV cache
        return bw
    x = torch.empty(64 << 20, dtype=torch.uint8)   # the CPU figure only makes --quick's arithmetic complete
    y = torch.empty_like(x)
    y.copy_(x)
    start = time.perf_counter()
    for _ in range(5):
        y.copy_(x)
    return 2 * 5 * x.numel() / (time.perf_counter() - start)


def experts_impl(model: torch.nn.Module) -> str | None:
    impl = next((m.impl for m in model.modules() if isinstance(m, FusedExperts)), None)
    return None if impl is None else f"{impl.__module__}.{impl.__name__}"


def profile_decode(engine, prompt: list[int], steps: int, device: str, top: int = 25) -> dict:
    """Where a bs1 decode step's time goes: `steps` decode steps (and the prompt's one prefill) under torch.profiler,
    kernels by total device time (CPU: ops by self CPU time), per step. Never fails the bench."""
    try:
        from torch.profiler import ProfilerActivity, profile

        from benchmarks.step_profile import timed_events

        cuda = device.startswith("cuda")
        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            run_requests(engine, [prompt], steps + 1)
            if cuda:
                torch.cuda.synchronize()
        events = timed_events(prof, cuda)
        return {"steps": steps, "clock": "device" if cuda else "self cpu",
                "us_per_step": sum(us for us, _, _ in events) / steps,
                "launches_per_step": sum(n for _, n, _ in events) / steps,
                "top": [{"us_per_step": us / steps, "calls_per_step": n / steps, "name": name[:120]}
                        for us, n, name in events[:top]]}
    except Exception as exc:   # noqa: BLE001 - a profiler hiccup must not lose the timings
        return {"error": repr(exc)[:300]}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default=None, choices=sorted(SHAPES), help="benchmarks/shapes.py name "
                    f"(default: qwen3-30b-a3b; {QUICK_SHAPE} with --quick)")
    ap.add_argument("--out", required=True, help="JSON report path")
    ap.add_argument("--workdir", default=None, help="where config.json + tokenizer are written (default: a temp dir)")
    ap.add_argument("--quick", action="store_true", help="CPU, a tiny config, a few tokens: checks the whole road")
    ap.add_argument("--device", default=None, help="default: cuda (cpu with --quick)")
    ap.add_argument("--prompt-len", type=int, default=None, help="default 128 (16 with --quick)")
    ap.add_argument("--output-len", type=int, default=None, help="default 256 (8 with --quick)")
    ap.add_argument("--concurrency", type=int, default=None, help="default 128 (4 with --quick)")
    ap.add_argument("--bs1-prompts", type=int, default=2, help="prompts timed one at a time for bs1")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--disable-cuda-graph", action="store_true")
    ap.add_argument("--profile-steps", type=int, default=None, help="bs1 decode steps run under torch.profiler "
                    "for a per-kernel split, 0: none (default 16; 2 with --quick)")
    args = ap.parse_args(argv)
    quick = args.quick
    args.shape = args.shape or (QUICK_SHAPE if quick else "qwen3-30b-a3b")
    args.device = args.device or ("cpu" if quick else "cuda")
    args.prompt_len = args.prompt_len or (16 if quick else 128)
    args.output_len = args.output_len or (8 if quick else 256)
    args.concurrency = args.concurrency or (4 if quick else 128)
    if args.profile_steps is None:
        args.profile_steps = 2 if quick else 16
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    from kestrel.envs import switches

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report: dict = {"shape": args.shape, "config": SHAPES[args.shape], "device": args.device,
                    "torch": torch.__version__, "load_format": "dummy", "fused_moe_switch": switches().fused_moe,
                    "workload": {"prompt_len": args.prompt_len, "output_len": args.output_len,
                                 "concurrency": args.concurrency, "bs1_prompts": args.bs1_prompts}}

    def save() -> None:
        out.write_text(json.dumps(report, indent=1))

    try:
        run(args, report, save)
    except Exception as exc:   # the report keeps what was measured, and says what stopped it
        report["error"] = repr(exc)[:500]
        save()
        raise
    print(json.dumps(report, indent=1))
    return 0


def run(args: argparse.Namespace, report: dict, save) -> None:
    from kestrel import LLM

    if args.device.startswith("cuda"):
        report["gpu"] = torch.cuda.get_device_name()
    say(f"{args.shape} on {args.device}: measuring the copy bandwidth")
    bw = copy_bandwidth(args.device)
    report["copy_bandwidth_gb_s"] = bw / 1e9
    report["bandwidth_convention"] = "device-to-device copy, (bytes read + bytes written) / s; roofline = bytes a " \
                                     "step reads / this"
    save()

    model_dir = write_config_only(args.shape, Path(args.workdir or tempfile.mkdtemp(prefix="kestrel-moe-"))
                                  / args.shape)
    say(f"starting the engine on {model_dir} (dummy weights)")
    t0 = time.perf_counter()
    llm = LLM(model=str(model_dir), device=args.device, load_format="dummy", max_model_len=args.max_model_len,
              max_num_seqs=max(args.concurrency, 8), cuda_graph_max_bs=args.concurrency,
              disable_cuda_graph=args.disable_cuda_graph)
    engine, runner = llm.engine, llm.engine.runner
    cfg = runner.cfg
    report["startup_s"] = time.perf_counter() - t0
    report["startup_phases_s"] = {k: round(v, 3) for k, v in engine.progress.phase_durations.items()}
    report["dtype"] = str(runner.dtype).removeprefix("torch.")
    report["attention_backend"] = runner.backend.name
    report["decode_cuda_graphs"] = runner.graphs is not None
    report["experts_impl"] = experts_impl(runner.model)
    mb = moe_bytes(runner.model, cfg)
    report["weight_bytes"] = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    report["expert_bytes"] = mb.expert_bytes
    kv = kv_bytes_per_token(cfg, runner.dtype)
    report["kv_bytes_per_token"] = kv
    report["kv_bytes_per_token_same_width"] = gqa_kv_bytes_per_token(cfg, runner.dtype)
    mean_context = args.prompt_len + args.output_len / 2
    report["roofline"] = rooflines(mb, kv, bw, args.concurrency, mean_context)
    say(f"started in {report['startup_s']:.1f} s: graphs {report['decode_cuda_graphs']}, experts "
        f"{report['experts_impl']}, {report['weight_bytes'] / 1e9:.2f} GB of weights, "
        f"{report['roofline']['active_weight_bytes_per_token'] / 1e9:.3f} GB active a token")
    save()

    vocab = cfg.vocab_size
    # every prompt new (no prefix shared with anything sent before, warm-ups included): each timing's
    # prefix_cache_hit_rate is 0.0 unless something went wrong
    fresh = FreshPrompts(vocab, seed=0)
    say("bs1: warm-up")
    run_requests(engine, fresh.take(1, args.prompt_len), 8)
    say(f"bs1: {args.bs1_prompts} prompt(s) x {args.output_len} tokens")
    report["bs1"] = single_stream(engine, fresh.take(args.bs1_prompts, args.prompt_len), args.output_len)
    report["bs1"]["fraction_of_roofline"] = report["bs1"]["decode_tok_s"] / report["roofline"]["bs1_roofline_tok_s"]
    say(f"bs1: {report['bs1']['decode_tok_s']:.1f} decode tok/s = "
        f"{report['bs1']['fraction_of_roofline']:.2f} of the roofline")
    save()

    if args.profile_steps:
        say(f"bs1: kernel profile of {args.profile_steps} decode steps")
        report["bs1_kernel_profile"] = profile_decode(engine, fresh.one(args.prompt_len), args.profile_steps,
                                                      args.device)
        save()

    say(f"c{args.concurrency}: warm-up")
    # prompts of their own: the timed ones must not find their prefixes cached by the warm-up
    run_requests(engine, fresh.take(args.concurrency, args.prompt_len), 4)
    conc = fresh.take(args.concurrency, args.prompt_len)
    say(f"c{args.concurrency}: {args.concurrency} prompts x {args.output_len} tokens")
    r = run_requests(engine, conc, args.output_len)
    c = args.concurrency
    tok_s = r["output_tokens"] / r["wall_s"]
    # after the last first token every sequence decodes together: the rate the decode roofline speaks of
    decode_s = r["wall_s"] - r["ttft_s"][-1]
    decode_tok_s = (r["output_tokens"] - c) / decode_s if decode_s > 0 else None
    roof = report["roofline"][f"c{c}_roofline_tok_s"]
    report[f"c{c}"] = {"output_tok_s": tok_s, "wall_s": r["wall_s"], "output_tokens": r["output_tokens"],
                       "ttft_p50_ms": 1000 * r["ttft_s"][len(r["ttft_s"]) // 2],
                       "ttft_max_ms": 1000 * r["ttft_s"][-1], "decode_tok_s": decode_tok_s,
                       "fraction_of_roofline": decode_tok_s / roof if decode_tok_s else None,
                       "output_fraction_of_roofline": tok_s / roof,
                       **{k: v for k, v in r.items() if k.startswith("prefix_cache_")}}
    say(f"c{c}: {tok_s:.1f} output tok/s (prefill included), {decode_tok_s or 0:.1f} decode tok/s after the last "
        f"first token = {report[f'c{c}']['fraction_of_roofline'] or 0:.2f} of the roofline")
    save()
    llm.shutdown()


if __name__ == "__main__":
    sys.exit(main())
