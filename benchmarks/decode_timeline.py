"""Where the cluster decode kernel's time goes, step by step inside it (attention/cluster_decode.cu, STAMPS=1).

On the Llama-3.1-8B bs1 step, decode attention is ~7 us of exposed time per layer for ~1.5 MB of K/V. Its critical
path is a chain of latencies, and two fixes that looked sure went the other way (session 13: skipping masked keys
made it slower; HBM traffic beside it made it much slower). Measuring beats guessing. This builds the kernel with
STAMPS=1: thread 0 of every program records clock64() at eight points and %globaltimer at entry and end. It launches
the kernel alone, REPEATS times per context length (8B and 0.6B shapes, bs1), and prints the median cycles and us of
each segment:

    wait       entry -> after griddepcontrol.wait (alone: ~0; in the step it is the kernel before)
    attend     the q loads, the newest key's K/V and the first attend step (PREFETCH keys a slot)
    chunks     the later chunks of longer contexts (read after the wait)
    slot merge slots -> program, through shared memory
    barrier 1  the first cluster barrier (every program's partial ready)
    merge      the peers' partials over DSMEM, the output stores
    barrier 2  the last cluster barrier (no program leaves while a peer reads its shared memory)

and the span of a launch (first program's entry to last program's end, %globaltimer). Cycles convert to us at the
SM clock the driver reports, so the us column is approximate when clocks move; the cycles are exact.

    python -m benchmarks.decode_timeline --out /tmp/decode_timeline.json
"""
from __future__ import annotations

import argparse
import ctypes
import statistics

import torch

from benchmarks import write_json
from kestrel import cuda_rtc
from kestrel.attention import cluster_decode

SEGMENTS = ["wait", "attend", "chunks", "slot merge", "barrier 1", "merge", "barrier 2"]
STAMP_COLUMNS = len(SEGMENTS) + 1 + 2   # cluster_decode.cu's NUM_STAMPS clocks, then two %globaltimer values
SHAPES = {"llama-3.1-8b": (8, 4, 128), "qwen3-0.6b": (8, 2, 128)}   # kv heads, group, head_dim
CU_DEVICE_ATTRIBUTE_CLOCK_RATE = 13   # kHz


def stamped_kernel(group: int, head_dim: int, cluster: int, block_size: int, device: int,
                   tensor_cores: bool) -> cuda_rtc.Kernel:
    compiled = cluster_decode.compile_kernel(group, head_dim, cluster, block_size, cuda_rtc.device_arch(device),
                                             index64=True, extra={"STAMPS": 1}, tensor_cores=tensor_cores)
    return cuda_rtc.Kernel(compiled, "cluster_decode", torch.device("cuda", device), non_portable_cluster=cluster > 8)


def timeline(shape: str, kv_len: int, repeats: int, tensor_cores: bool, block_size: int = 16) -> dict:
    """Median cycles of each segment over every program of `repeats` launches at one context length, on the
    CUDA-core or the tensor-core build."""
    num_kv_heads, group, head_dim = SHAPES[shape]
    cluster = cluster_decode.cluster_size() or 8
    device = torch.cuda.current_device()
    gen = torch.Generator(device="cuda").manual_seed(kv_len)
    blocks = -(-kv_len // block_size)
    k_cache = torch.randn(blocks, block_size, num_kv_heads, head_dim, device="cuda", generator=gen).to(torch.bfloat16)
    v_cache = torch.randn(k_cache.shape, device="cuda", generator=gen).to(torch.bfloat16)
    q = torch.randn(1, num_kv_heads * group, head_dim, device="cuda", generator=gen).to(torch.bfloat16)
    table = torch.randperm(blocks, device="cuda", generator=gen).view(1, -1)
    lens = torch.tensor([kv_len], device="cuda")
    out = torch.empty_like(q)
    programs = num_kv_heads * cluster
    stamps = torch.zeros(programs, STAMP_COLUMNS, dtype=torch.int64, device="cuda")
    kernel = stamped_kernel(group, head_dim, cluster, block_size, device, tensor_cores)
    args = cluster_decode.launch_args(q, k_cache, v_cache, table, lens, out, head_dim ** -0.5)
    args.append(ctypes.c_void_p(stamps.data_ptr()))
    warps = cluster_decode.num_warps(group, head_dim, tensor_cores)
    stream = torch.cuda.current_stream()
    per_segment: list[list[int]] = [[] for _ in SEGMENTS]
    spans = []
    for i in range(repeats + 5):
        kernel.launch((programs, 1, 1), warps * 32, args, stream, cluster=cluster)
        torch.cuda.synchronize()
        if i < 5:   # warm-up
            continue
        rows = stamps.cpu().tolist()
        for row in rows:
            for s in range(len(SEGMENTS)):
                per_segment[s].append(row[s + 1] - row[s])
        spans.append(max(r[-1] for r in rows) - min(r[-2] for r in rows))
    want = cluster_decode.decode_attention(q, k_cache, v_cache, table, lens, head_dim ** -0.5,
                                           tensor_cores=tensor_cores)
    assert torch.equal(out, want), "the stamped build computed something else"
    return {"cycles": {name: statistics.median(v) for name, v in zip(SEGMENTS, per_segment)},
            "span_ns": statistics.median(spans)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", default="128,256,384,1024,4096")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--builds", default="cuda-cores,tensor-cores", help="KESTREL_CLUSTER_DECODE_MMA=0 / =1")
    parser.add_argument("--out")
    args = parser.parse_args()
    mhz = cuda_rtc.device_attribute(torch.cuda.current_device(), CU_DEVICE_ATTRIBUTE_CLOCK_RATE) / 1000
    results = {"gpu": torch.cuda.get_device_name(), "sm_clock_mhz": mhz, "rows": []}
    print(f"cluster decode, one sequence, stamps by program thread 0; us at {mhz:.0f} MHz")
    print("| shape | build | context | " + " | ".join(SEGMENTS) + " | total us | launch span us |")
    print("|---|---|---|" + "---|" * (len(SEGMENTS) + 2))
    for shape in SHAPES:
        for build in args.builds.split(","):
            for kv_len in map(int, args.contexts.split(",")):
                row = timeline(shape, kv_len, args.repeats, tensor_cores=build == "tensor-cores")
                cycles = row["cycles"]
                results["rows"].append({"shape": shape, "build": build, "context": kv_len, **row})
                us = [c / mhz for c in cycles.values()]
                print(f"| {shape} | {build} | {kv_len} | " + " | ".join(f"{u:.2f}" for u in us)
                      + f" | {sum(us[1:]):.2f} | {row['span_ns'] / 1000:.2f} |", flush=True)
    write_json(args.out, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
