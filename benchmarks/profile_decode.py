"""Where a bs1 decode step's time goes, on the GPU: kernel table from torch.profiler over CUDA graph replays.

For each model shape: one 128-token prompt is prefilled, then
  - engine.step() wall time per decode token (what the bs1 benchmark sees),
  - graph replay alone, back to back, timed with CUDA events (the GPU's time per step),
  - a profile of a few replays: per kernel name, launches and microseconds per step, plus the idle gaps
    between kernels (replay span minus kernel time).
Writes JSON (--out) and prints the tables.

KESTREL_PROFILE_ABLATE=decode,prologue,norm,silu,cluster_merge (any of them) takes work out of the captured step to see what the
rest costs without it (the tokens are garbage; only the timing means anything): `decode` makes decode attention
return its q unchanged (o_proj reads q), `prologue` makes the fused q/k norm + rotary + K/V write return qkv's q
columns untouched (with both, o_proj's input is a strided view, so one copy kernel appears); `norm` and `silu`
take the add-RMSNorm and the SiLU-mul out of the skinny matmuls that fold them in (qkv and gate_up read the
hidden state as it is; down reads the gate half), so those matmuls keep their weights and grids; `cluster_merge`
builds the cluster decode kernel without the merge of its programs' partials.

    python -m benchmarks.profile_decode --models qwen3-0.6b,llama-3.1-8b --workdir /tmp/kestrel-bench
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import time
from collections import defaultdict
from pathlib import Path

import torch

from benchmarks.host_timing import GcPauses, interval_summary
from benchmarks.roofline import decode_weight_bytes, weight_bytes
from benchmarks.shapes import SHAPES, write_random_checkpoint
from kestrel.config import EngineConfig
from kestrel.engine.engine import Engine
from kestrel.sampling_params import SamplingParams


def _kernel_events(prof) -> list[tuple[str, float, float]]:
    """(name, start_us, duration_us) of every GPU kernel/memcpy the profiler saw, sorted by start."""
    out = []
    for e in prof.events():
        if getattr(e.device_type, "name", str(e.device_type)) != "CUDA":
            continue
        tr = e.time_range
        out.append((e.name, float(tr.start), float(tr.end - tr.start)))
    return sorted(out, key=lambda x: x[1])


def exposed_per_launch(events: list[tuple[str, float, float]]) -> list[float]:
    """The time each launch pushes the end of GPU work out: its end past the latest end so far, counted from its
    own start. Under PDL a kernel's duration includes waiting on the one before it, so durations overlap and
    over-count; these shares do not, and they sum to the busy part of the span."""
    out = []
    frontier = float("-inf")
    for _, start, dur in events:   # sorted by start
        end = start + dur
        out.append(max(0.0, end - max(frontier, start)))
        frontier = max(frontier, end)
    return out


def exposed_time(events: list[tuple[str, float, float]]) -> dict[str, float]:
    """Per kernel name, the exposed time of its launches (exposed_per_launch), summed."""
    exposed: dict[str, float] = defaultdict(float)
    for (name, _, _), t in zip(events, exposed_per_launch(events)):
        exposed[name] += t
    return exposed


def slot_table(events: list[tuple[str, float, float]], steps: int, num_layers: int) -> list[dict]:
    """A kernel launched several times per layer (the skinny matmul: qkv, o_proj, gate_up, down) split by its
    place in the layer: the i-th launch of a name with `per_layer` launches a layer is slot i % per_layer. Each
    row: name, slot, us and exposed us each, and the kernel most often right before it."""
    counts: dict[str, int] = defaultdict(int)
    for name, _, _ in events:
        counts[name] += 1
    per_layer = {n: c // (steps * num_layers) for n, c in counts.items()
                 if c % (steps * num_layers) == 0 and c // (steps * num_layers) >= 2}
    seen: dict[str, int] = defaultdict(int)
    rows: dict[tuple[str, int], dict] = {}
    for i, ((name, _, dur), exposed) in enumerate(zip(events, exposed_per_launch(events))):
        if name not in per_layer:
            continue
        slot = seen[name] % per_layer[name]
        seen[name] += 1
        row = rows.setdefault((name, slot), {"name": name[:120], "slot": slot, "launches": 0, "us": 0.0,
                                             "exposed_us": 0.0, "after": defaultdict(int)})
        row["launches"] += 1
        row["us"] += dur
        row["exposed_us"] += exposed
        row["after"][events[i - 1][0][:60] if i else "-"] += 1
    return [{"name": r["name"], "slot": r["slot"], "us_each": round(r["us"] / r["launches"], 2),
             "exposed_us_each": round(r["exposed_us"] / r["launches"], 2),
             "after": max(r["after"], key=r["after"].get)} for r in rows.values()]


def ablations(spec: str) -> list[tuple[object, str, object]]:
    """(module, attribute, stand-in) for each name in a comma-separated KESTREL_PROFILE_ABLATE spec."""
    from kestrel.attention import cluster_decode, triton_kernels
    from kestrel.layers import attention_prologue, gemv

    plain_gemv = gemv.gemv

    def decode_returns_q(q, *args, **kwargs):
        return q

    def prologue_returns_q(qkv, q_norm_w, k_norm_w, eps, positions, cos_sin_cache, k_cache, v_cache, slots,
                           num_heads, num_kv_heads, head_dim):
        return qkv[:, :num_heads * head_dim].view(-1, num_heads, head_dim)

    def gemv_without_norm(x, residual, norm_weight, eps, w, bias=None, config=None):
        return plain_gemv(x, w, bias, config), (x if residual is None else residual)

    def gemv_without_silu(gate_up, w, bias=None, config=None):
        return plain_gemv(gate_up[:, :gate_up.shape[1] // 2], w, bias, config)

    cluster_defines = cluster_decode.defines

    def cluster_defines_without_merge(*args, **kwargs):
        return {**cluster_defines(*args, **kwargs), "MERGE": 0}

    table = {"decode": [(triton_kernels, "decode_attention", decode_returns_q),
                        (cluster_decode, "decode_attention", decode_returns_q)],
             "prologue": [(attention_prologue, "qk_norm_rope_store", prologue_returns_q)],
             "norm": [(gemv, "add_rms_norm_gemv", gemv_without_norm)],
             "silu": [(gemv, "silu_mul_gemv", gemv_without_silu)],
             # the cluster kernel's programs each write their own partial: no cluster barrier, no peer reads
             "cluster_merge": [(cluster_decode, "defines", cluster_defines_without_merge)]}
    names = [n for n in spec.split(",") if n]
    unknown = set(names) - set(table)
    if unknown:
        raise SystemExit(f"KESTREL_PROFILE_ABLATE: unknown {sorted(unknown)}; known: {sorted(table)}")
    return [patch for n in names for patch in table[n]]


def profile_model(name: str, workdir: Path, steps: int, trace_dir: Path | None, graph_max_bs: int = 8,
                  max_num_seqs: int = 8) -> dict:
    """graph_max_bs / max_num_seqs: 8 by default; engine_bench.py's engine uses 128 / 256 (--like-bench)."""
    model_dir = workdir / name
    if not (model_dir / "config.json").exists():
        write_random_checkpoint(name, model_dir)
    engine = Engine(EngineConfig(model=str(model_dir), device="cuda", cuda_graph_max_bs=graph_max_bs,
                                 max_num_seqs=max_num_seqs))
    vocab = SHAPES[name]["vocab_size"]
    prompt = [(i * 7919) % (vocab - 2) + 2 for i in range(128)]
    engine.add_request("p", prompt, SamplingParams(max_tokens=4096, temperature=0.0, ignore_eos=True))
    for _ in range(20):   # prefill + warm decode steps
        engine.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    stamps = []
    with GcPauses() as gc_pauses:
        for _ in range(steps):
            engine.step()
            stamps.append(time.perf_counter())
    step_ms = 1000 * (stamps[-1] - t0) / steps

    graphs = engine.runner.graphs
    result = {"model": name, "engine_step_ms": step_ms, "tok_s": 1000 / step_ms,
              "fused_attn_prologue": os.environ.get("KESTREL_FUSED_ATTN_PROLOGUE", "1") != "0",
              "skinny_matmul": os.environ.get("KESTREL_SKINNY_MATMUL", "auto"),
              "cuda_gemv": os.environ.get("KESTREL_CUDA_GEMV", "auto"),
              "overlap_schedule": True, "ablate": os.environ.get("KESTREL_PROFILE_ABLATE", ""),
              "cuda_graph_max_bs": graph_max_bs, "max_num_seqs": max_num_seqs,
              "step_intervals": interval_summary([b - a for a, b in zip(stamps, stamps[1:])]),
              "gc_pauses": gc_pauses.summary()}
    if graphs is None:
        return result
    graph = graphs.graphs[graphs.buckets[0]]   # bs1 replays the smallest bucket (KESTREL_GRAPH_MIN_BS)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(5):
        graph.replay()
    start.record()
    for _ in range(steps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    result["graph_replay_ms"] = start.elapsed_time(end) / steps

    n_prof = 10
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(n_prof):
            graph.replay()
        torch.cuda.synchronize()
    events = _kernel_events(prof)
    if trace_dir is not None:
        prof.export_chrome_trace(str(trace_dir / f"trace_{name}.json"))
    per_name: dict[str, list[float]] = defaultdict(list)
    exposed_by_name = exposed_time(events)
    for kname, _, dur in events:
        per_name[kname].append(dur)
    table = sorted(((k, len(v) / n_prof, sum(v) / n_prof) for k, v in per_name.items()), key=lambda r: -r[2])
    busy = sum(d for _, _, d in events) / n_prof
    span = (events[-1][1] + events[-1][2] - events[0][1]) / n_prof if events else 0.0
    result.update({"kernels_per_step": len(events) / n_prof, "kernel_us_per_step": busy,
                   "span_us_per_step": span, "gap_us_per_step": span - busy,
                   "kernels": [{"name": k[:120], "launches": c, "us_per_step": round(t, 2),
                                "us_each": round(t / c, 2),
                                "exposed_us_each": round(exposed_by_name[k] / n_prof / c, 2)}
                               for k, c, t in table],
                   "exposed_us_per_step": sum(exposed_by_name.values()) / n_prof,
                   "kernels_by_slot": slot_table(events, n_prof, engine.runner.cfg.num_layers)})
    result["weight_gb"] = weight_bytes(engine.runner.model) / 1e9
    result["decode_weight_gb"] = decode_weight_bytes(engine.runner.model) / 1e9
    del engine
    torch.cuda.empty_cache()
    return result


def print_result(r: dict) -> None:
    ablated = f"; ablated: {r['ablate']}" if r.get("ablate") else ""
    print(f"\n## {r['model']} bs1 decode (fused attention prologue: {r['fused_attn_prologue']}, skinny matmuls: "
          f"{r['skinny_matmul']}{ablated})")
    print(f"engine.step {r['engine_step_ms']:.3f} ms ({r['tok_s']:.0f} tok/s); graph replay "
          f"{r.get('graph_replay_ms', float('nan')):.3f} ms; kernels/step {r.get('kernels_per_step', 0):.0f}, "
          f"kernel time {r.get('kernel_us_per_step', 0):.0f} us, idle gaps {r.get('gap_us_per_step', 0):.0f} us")
    print(f"host intervals between step() returns: {r.get('step_intervals')}; gc pauses: {r.get('gc_pauses')}")
    print(f"busy (exposed) {r.get('exposed_us_per_step', 0):.0f} us per step")
    print("| kernel | launches/step | us/step | us each | exposed us each |\n|---|---|---|---|---|")
    for k in r.get("kernels", [])[:25]:
        print(f"| {k['name'][:90]} | {k['launches']:.0f} | {k['us_per_step']:.1f} | {k['us_each']:.2f} "
              f"| {k['exposed_us_each']:.2f} |")
    if r.get("kernels_by_slot"):
        print("| kernel, by its place in the layer | slot | us each | exposed us each | right after |\n"
              "|---|---|---|---|---|")
        for k in r["kernels_by_slot"]:
            print(f"| {k['name'][:60]} | {k['slot']} | {k['us_each']:.2f} | {k['exposed_us_each']:.2f} "
                  f"| {k['after'][:50]} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen3-0.6b,llama-3.1-8b")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/kestrel-bench"))
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--trace-dir", type=Path, default=None)
    ap.add_argument("--like-bench", action="store_true",
                    help="the engine settings of engine_bench.py (graphs up to 128 rows, 256 sequences): the bs1 "
                         "step there measured ~1.2%% slower than here (BENCHMARKS.md, session 14); also "
                         "KESTREL_PROFILE_LIKE_BENCH=1, so that the suite can A/B it against its baseline")
    args = ap.parse_args()
    like_bench = args.like_bench or os.environ.get("KESTREL_PROFILE_LIKE_BENCH") == "1"
    engine_sizes = (128, 256) if like_bench else (8, 8)
    for module, attr, stand_in in ablations(os.environ.get("KESTREL_PROFILE_ABLATE", "")):
        setattr(module, attr, stand_in)   # before any engine is built, so its graphs capture the stand-ins
    results = []
    for name in args.models.split(","):
        r = profile_model(name, args.workdir, args.steps, args.trace_dir, *engine_sizes)
        print_result(r)
        results.append(r)
        gc.collect()               # the engine's reference cycles hold its weights and KV cache: free them before
        torch.cuda.empty_cache()   # the next model (session 12: the 0.6B found no memory after the 8B)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
