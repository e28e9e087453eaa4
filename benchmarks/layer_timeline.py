"""Where a Llama-3.1-8B bs1 layer's time goes between and inside its matmuls (layers/skinny_gemv.cu, STAMPS=1).

The 8B bs1 step spends ~11 us a layer beyond its weight bytes at copy bandwidth: qkv ~3 us over its 50 MB, o_proj
~2.4 over its 34 MB, decode attention ~4.5 exposed (BENCHMARKS.md, session 15). The profile's kernel table gives
each kernel's exposed time, not what happens inside it. This runs LAYERS layers of the 8B's decode chain with
random bf16 weights of the real shapes (3.5 GB, past the 50 MB L2), the kernels the engine runs at bs1:

    qkv      add_rms_norm_gemv_rope (add + RMSNorm, the QKV matmul, rotary, the K/V write)
    decode   cluster_decode (its STAMPS build, as benchmarks/decode_timeline.py: thread 0 of each program)
    o_proj   gemv
    gate_up  add_rms_norm_gemv_silu
    down     gemv

inside one CUDA graph with PDL, as the engine's graph. Every matmul is the STAMPS build: lane 0 of every warp
records clock64() at entry, the PDL wait's release, the staged activation, step 0 consumed, the last step
consumed and the stores done, and %globaltimer at entry, the release and the end. Per matmul (median over layers
1.. and replays) it prints, in us from the end of the kernel before it (its last warp's end; for o_proj, qkv's):

    entry      the first warp's entry (negative: launched early by PDL)
    release    the first warp's and the median warp's release from the wait
    segments   per warp (median): staging, step 0, later steps, tail (clock64, converted at the measured clock)
    end        the median warp's end and the last warp's end (the last is the kernel's exposed time)

    python -m benchmarks.layer_timeline --out /tmp/layer_timeline.json [--layers 8 --context 256 --replays 20]

KESTREL_CUDA_GEMV_CONFIG and the decode kernel's switches apply as in the engine, so an A/B is a second run.
"""
from __future__ import annotations

import argparse
import ctypes
import math
import statistics

import torch

from benchmarks import write_json
from benchmarks.decode_timeline import SEGMENTS as DECODE_SEGMENTS, STAMP_COLUMNS as DECODE_COLUMNS, stamped_kernel
from kestrel import cuda_rtc
from kestrel.attention import cluster_decode
from kestrel.layers import cuda_gemv
from kestrel.layers.pdl import pdl_enabled

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 4096, 32, 8, 128, 14336   # Llama-3.1-8B
EPS, BLOCK_SIZE = 1e-5, 16
MATMULS = ["qkv", "o_proj", "gate_up", "down"]
SEGMENTS = ["staging", "step 0", "later steps", "tail"]   # clock64 stamps 1 -> 2 -> 3 -> 4 -> 5
LATE = "decode, last at barrier 1"
CLOCKS = 6   # skinny_gemv.cu's NUM_STAMPS; columns CLOCKS.. are %globaltimer (entry, release, end)


def _layer_weights(gen: torch.Generator) -> dict[str, torch.Tensor]:
    def weight(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)

    def norm() -> torch.Tensor:
        return (1 + 0.1 * torch.randn(HIDDEN, device="cuda", generator=gen)).to(torch.bfloat16)

    return {"qkv": weight((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN), "o_proj": weight(HIDDEN, HIDDEN),
            "gate_up": weight(2 * INTERMEDIATE, HIDDEN), "down": weight(HIDDEN, INTERMEDIATE),
            "norm1": norm(), "norm2": norm()}


class Chain:
    """LAYERS layers of the 8B's bs1 decode chain on fixed buffers, so that a CUDA graph can replay it."""

    def __init__(self, layers: int, context: int, seed: int = 0):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        self.weights = [_layer_weights(gen) for _ in range(layers)]
        blocks = math.ceil(context / BLOCK_SIZE)
        cache_shape = (blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
        self.caches = [(torch.randn(cache_shape, device="cuda", generator=gen).to(torch.bfloat16),
                        torch.randn(cache_shape, device="cuda", generator=gen).to(torch.bfloat16))
                       for _ in range(layers)]
        # int64 tables: the decode kernel's stamped build is its 64-bit index build
        self.block_table = torch.randperm(blocks, device="cuda", generator=gen).view(1, -1)
        self.kv_lens = torch.tensor([context], dtype=torch.int64, device="cuda")
        last = context - 1   # the new token: its K/V go to its slot, then attention reads them
        self.positions = torch.tensor([last], dtype=torch.int64, device="cuda")
        slot = self.block_table[0, last // BLOCK_SIZE].item() * BLOCK_SIZE + last % BLOCK_SIZE
        self.slots = torch.tensor([slot], dtype=torch.int64, device="cuda")
        angles = torch.outer(torch.arange(context + 1, device="cuda", dtype=torch.float32),   # [position, half]
                             500000.0 ** (-torch.arange(0, HEAD_DIM, 2, device="cuda") / HEAD_DIM))
        self.cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1).contiguous()   # [cos | sin], fp32
        self.x = torch.randn(1, HIDDEN, device="cuda", generator=gen).to(torch.bfloat16)
        self.residual = torch.randn(1, HIDDEN, device="cuda", generator=gen).to(torch.bfloat16)
        shapes = {"qkv": ((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN, False), "o_proj": (HIDDEN, HIDDEN, False),
                  "gate_up": (INTERMEDIATE, HIDDEN, True), "down": (HIDDEN, INTERMEDIATE, False)}
        self.stamps = [{name: torch.zeros(cuda_gemv.stamp_rows(*shape), cuda_gemv.STAMP_COLUMNS, dtype=torch.int64,
                                          device="cuda") for name, shape in shapes.items()} for _ in range(layers)]
        group, self.cluster = HEADS // KV_HEADS, cluster_decode.cluster_size()
        tensor_cores = cluster_decode.mma(group, HEAD_DIM)
        self.decode_kernel = stamped_kernel(group, HEAD_DIM, self.cluster, BLOCK_SIZE, torch.cuda.current_device(),
                                            tensor_cores)
        self.decode_warps = cluster_decode.num_warps(group, HEAD_DIM, tensor_cores)
        for stamps in self.stamps:
            stamps["decode"] = torch.zeros(KV_HEADS * self.cluster, DECODE_COLUMNS, dtype=torch.int64, device="cuda")
        self.out = torch.empty_like(self.x)

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               stamps: torch.Tensor | None) -> torch.Tensor:
        """Decode attention: the engine's launch, or (stamps) the same launch of the STAMPS build."""
        if stamps is None:
            return cluster_decode.decode_attention(q, k_cache, v_cache, self.block_table, self.kv_lens,
                                                   HEAD_DIM ** -0.5)
        out = torch.empty_like(q)
        args = cluster_decode.launch_args(q, k_cache, v_cache, self.block_table, self.kv_lens, out, HEAD_DIM ** -0.5)
        args.append(ctypes.c_void_p(stamps.data_ptr()))
        self.decode_kernel.launch((KV_HEADS * self.cluster, 1, 1), self.decode_warps * 32, args,
                                  torch.cuda.current_stream(), cluster=self.cluster, pdl=pdl_enabled(q.device))
        return out

    def run(self, stamped: bool = True) -> torch.Tensor:
        """One pass through every layer; the last down's output lands in self.out."""
        x, residual = self.x, self.residual
        for w, (k_cache, v_cache), stamps in zip(self.weights, self.caches, self.stamps):
            s = stamps if stamped else dict.fromkeys(stamps)
            q, h = cuda_gemv.add_rms_norm_gemv_rope(
                x, residual, w["norm1"], EPS, w["qkv"], None, self.positions, self.cos_sin, k_cache, v_cache,
                self.slots, HEADS, KV_HEADS, HEAD_DIM, stamps=s["qkv"])
            attn = self.decode(q, k_cache, v_cache, s["decode"])
            o = cuda_gemv.gemv(attn.view(1, HIDDEN), w["o_proj"], stamps=s["o_proj"])
            act, residual = cuda_gemv.add_rms_norm_gemv_silu(o, h, w["norm2"], EPS, w["gate_up"],
                                                             stamps=s["gate_up"])
            x = cuda_gemv.gemv(act, w["down"], stamps=s["down"])
        self.out.copy_(x)
        return self.out


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def analyse(stamps: list[dict[str, torch.Tensor]], cluster: int) -> dict:
    """One replay's stamps -> per matmul, per layer past the first: ns from the previous kernel's last end.
    Decode also reports, per cluster, the program that reached the first cluster barrier last (the one whose wait
    there was shortest: clock64 is per SM, so programs compare by their own segments, not by clock values)."""
    rows = [{name: t.cpu() for name, t in layer.items()} for layer in stamps]
    per: dict[str, dict[str, list[float]]] = {name: {} for name in MATMULS}
    ns_per_cycle = []
    for i in range(1, len(rows)):
        before = {"qkv": rows[i - 1]["down"], "o_proj": rows[i]["qkv"], "gate_up": rows[i]["o_proj"],
                  "down": rows[i]["gate_up"]}
        decode = rows[i]["decode"].double()   # [program, 8 clocks + entry and end %globaltimer]
        qkv_end = rows[i]["qkv"][:, CLOCKS + 2].max().item()
        found = per.setdefault("decode", {})
        found.setdefault("entry first", []).append(decode[:, 8].min().item() - qkv_end)
        found.setdefault("end median", []).append(decode[:, 9].median().item() - qkv_end)
        found.setdefault("end last", []).append(decode[:, 9].max().item() - qkv_end)
        for j, segment in enumerate(DECODE_SEGMENTS):
            found.setdefault(segment, []).append((decode[:, j + 1] - decode[:, j]).median().item())
        late = per.setdefault(LATE, {})
        for block in decode.split(cluster):
            segments = block[:, 1:8] - block[:, 0:7]
            rank = int(segments[:, DECODE_SEGMENTS.index("barrier 1")].argmin())
            late.setdefault("rank", []).append(rank)
            late.setdefault("entry first", []).append(block[rank, 8].item() - qkv_end)
            for j, segment in enumerate(DECODE_SEGMENTS):
                late.setdefault(segment, []).append(segments[rank, j].item())
        found = per["o_proj"]
        found.setdefault("release after decode", []).append(
            (rows[i]["o_proj"][:, CLOCKS + 1].min() - rows[i]["decode"][:, 9].max()).item())
        for name in MATMULS:
            t = rows[i][name].double()
            prev_end = before[name][:, CLOCKS + 2].max().item()
            entry, release, end = (t[:, CLOCKS + j] - prev_end for j in range(3))
            clocks = t[:, :CLOCKS]
            ns_per_cycle.append(((t[:, CLOCKS + 2] - t[:, CLOCKS]) / (clocks[:, 5] - clocks[:, 0])).median().item())
            found = per[name]
            for key, value in (("entry first", entry.min()), ("release first", release.min()),
                               ("release median", release.median()), ("end median", end.median()),
                               ("end last", end.max())):
                found.setdefault(key, []).append(value.item())
            for s, segment in enumerate(SEGMENTS):
                found.setdefault(segment, []).append((clocks[:, s + 2] - clocks[:, s + 1]).median().item())
    return {"per": per, "ns_per_cycle": ns_per_cycle}


def blocks_per_sm(registers: int, threads: int, shared_bytes: int) -> int:
    """Resident blocks of one kernel on an H100/H200 SM: 64K registers (8 a thread at a time, rounded up),
    228 KB of shared memory (1 KB a block reserved), at most 2,048 threads."""
    by_registers = 65536 // (-(-registers // 8) * 8 * threads)
    return min(by_registers, 233472 // (shared_bytes + 1024), 2048 // threads)


def kernel_resources() -> list[dict]:
    """Registers and static shared memory of the chain's kernels (their STAMPS builds), and the blocks an SM holds
    against the production build's: the stamps cost registers, and where that changes the blocks an SM holds the
    chain misstates that kernel (session 17: down on one row a warp, 60 registers in production, 72 stamped:
    4 blocks an SM against 3, so its 512 blocks fit one wave in the engine and not in the chain)."""
    sources = {"skinny_gemv": cuda_gemv.SOURCE, "cluster_decode": cluster_decode.SOURCE}
    device = torch.device("cuda", torch.cuda.current_device())
    arch = cuda_rtc.device_arch(device.index)

    def resources(kernel: cuda_rtc.Kernel) -> tuple[int, int]:
        # the driver's figures: NVRTC's log does not always carry ptxas's register line on the GPU machine
        return (kernel.attribute(cuda_rtc.CU_FUNC_ATTRIBUTE_NUM_REGS),
                kernel.attribute(cuda_rtc.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES))

    rows = []
    for kernel in cuda_rtc.loaded_kernels():
        defines = dict(kernel.compiled.defines)
        if not defines.get("STAMPS"):
            continue
        keys = ("K", "ROWS", "WARPS", "U", "NORM", "SILU", "ROPE", "TMA_X", "PREWAIT", "GROUP", "CLUSTER", "MMA",
                "NUM_WARPS")
        threads = 32 * defines.get("WARPS", defines.get("NUM_WARPS", 0))
        production = cuda_rtc.Kernel(
            cuda_rtc.compile_cubin(sources[kernel.name].read_text(), kernel.name, arch,
                                   {key: value for key, value in defines.items() if key != "STAMPS"}),
            kernel.name, device, non_portable_cluster=defines.get("CLUSTER", 1) > 8)
        (registers, shared), (production_registers, production_shared) = resources(kernel), resources(production)
        rows.append({"kernel": kernel.name, "registers": registers, "production_registers": production_registers,
                     "shared_bytes": shared, "blocks_per_sm": blocks_per_sm(registers, threads, shared),
                     "production_blocks_per_sm": blocks_per_sm(production_registers, threads, production_shared),
                     "build": " ".join(f"{key}={defines[key]}" for key in keys if key in defines)})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.manual_seed(0)
    chain = Chain(args.layers, args.context)
    q_probe = torch.empty(1, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    assert cuda_gemv.usable(chain.x, chain.weights[0]["qkv"], norm=True) and cluster_decode.usable(
        q_probe, *chain.caches[0], 1), "needs a Hopper GPU with the CUDA matmuls and the cluster decode kernel"
    # The stamped build must compute what the engine's build computes (caches are rewritten identically).
    plain = chain.run(stamped=False).clone()
    stamped = chain.run(stamped=True).clone()
    assert torch.equal(plain, stamped), "the stamped build computed something else"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain.run(stamped=True)
    merged: dict[str, dict[str, list[float]]] = {name: {} for name in [*MATMULS, "decode", LATE]}
    ns_per_cycle: list[float] = []
    for replay in range(args.replays + 3):
        graph.replay()
        torch.cuda.synchronize()
        if replay < 3:   # warm-up
            continue
        found = analyse(chain.stamps, chain.cluster)
        ns_per_cycle += found["ns_per_cycle"]
        for name, keys in found["per"].items():
            for key, values in keys.items():
                merged[name].setdefault(key, []).extend(values)
    ns = _median(ns_per_cycle)
    cycles = {*SEGMENTS, *DECODE_SEGMENTS}
    ranks = merged[LATE].pop("rank")
    table = {name: {key: _median(values) / 1000 * (ns if key in cycles else 1.0) for key, values in keys.items()}
             for name, keys in merged.items()}
    table[LATE]["rank counts"] = {rank: ranks.count(rank) for rank in sorted(set(ranks))}
    decode_window = table["o_proj"]["release first"]
    print(f"8B bs1 layer chain, {args.layers} layers, context {args.context}, {args.replays} replays; "
          f"clock {1 / ns:.3f} GHz (clock64 against %globaltimer); us from the previous kernel's last warp's end "
          "(o_proj: qkv's; decode runs between)")
    keys = ["entry first", "release first", "release median", *SEGMENTS, "end median", "end last"]
    print("| matmul | " + " | ".join(keys) + " |")
    print("|---|" + "---|" * len(keys))
    for name in MATMULS:
        print(f"| {name} | " + " | ".join(f"{table[name][k]:.2f}" for k in keys) + " |")
    keys = ["entry first", *DECODE_SEGMENTS, "end median", "end last"]
    print("| decode (us from qkv's last end; segments: program thread 0's median) | " + " | ".join(keys) + " |")
    print("|---|" + "---|" * len(keys))
    print("| decode | " + " | ".join(f"{table['decode'][k]:.2f}" for k in keys) + " |")
    print(f"| {LATE} | " + " | ".join(f"{table[LATE][k]:.2f}" if k in table[LATE] else "" for k in keys) + " |")
    print(f"{LATE}, by rank in the cluster (the newest key is in the last rank's slice): {table[LATE]['rank counts']}")
    layer = sum(table[name]["end last"] for name in MATMULS)
    print(f"decode window (qkv's last end to o_proj's first release): {decode_window:.2f} us, of which decode's "
          f"last end to o_proj's first release {table['o_proj']['release after decode']:.2f}; "
          f"a layer (sum of the matmuls' last ends): {layer:.2f} us")
    kernels = kernel_resources()
    print("| kernel in the chain | registers (production) | static shared memory (bytes) | blocks an SM (production) "
          "| build |")
    print("|---|---|---|---|---|")
    for row in kernels:
        flag = "" if row["blocks_per_sm"] == row["production_blocks_per_sm"] else " **differs: this row misleads**"
        print(f"| {row['kernel']} | {row['registers']} ({row['production_registers']}) | {row['shared_bytes']} | "
              f"{row['blocks_per_sm']} ({row['production_blocks_per_sm']}){flag} | {row['build']} |")
    write_json(args.out, {"gpu": torch.cuda.get_device_name(), "layers": args.layers, "context": args.context,
                          "replays": args.replays, "ghz": 1 / ns, "table": table,
                          "decode_window_us": decode_window, "layer_us": layer, "kernels": kernels,
                          "carveout": cuda_rtc.shared_memory_carveout(),
                          "configs": {name: str(cuda_gemv.config_override(*shape) or "default") for name, shape in
                                      {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (14336, 4096),
                                       "down": (4096, 14336)}.items()}})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
