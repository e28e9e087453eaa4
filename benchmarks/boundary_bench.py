"""What one kernel boundary costs a chain of dependent phases on this GPU, against an in-kernel grid barrier.

The 0.6B bs1 decode step is a chain of 168 dependent kernels whose weights need ~1.8 us each at copy bandwidth
while each costs ~3.5 us exposed (BENCHMARKS.md, session 8). A persistent layer kernel would replace the kernel
boundaries with grid barriers; this measures both ways of running the same PHASES phases of the same work:

    chain     PHASES launches of _phase_kernel (with PDL on Hopper, as the decode kernels), in one CUDA graph:
              read this phase's weight tile, pdl_wait, read the neighbour's value the previous launch wrote,
              write our own.
    barrier   one launch of _barrier_kernel, one program per SM (all co-resident): the same phases, each ending
              in a grid barrier (CTA barrier, release atomic add on one counter; the next phase's weight tile is
              read, then every program spins on an acquire load until all arrived).

Per phase every program reads TILE bf16 weights (0: none; the 0.6B's matmuls read 16K a program) and one value
written by another program in the phase before, so each phase truly depends on the whole previous one. The
result is checked: after PHASES phases every value has grown by exactly PHASES.

    python -m benchmarks.boundary_bench --out /tmp/boundary.json
"""
from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from benchmarks.gemv_bench import replay_time_us
from kestrel.layers.pdl import launch_options, pdl_wait

PHASES = 168        # the 0.6B's dependent launches per decode step (6 per layer x 28)
REPLAYS = 20


@triton.jit
def _weight_sum(w_ptr, phase, pid, P, TILE: tl.constexpr):
    """Sum of this program's weight tile for `phase` (0.0 when TILE == 0): the bytes a matmul would stream."""
    if TILE > 0:
        offs = tl.arange(0, TILE)
        return tl.sum(tl.load(w_ptr + (phase * P + pid).to(tl.int64) * TILE + offs).to(tl.float32), 0)
    return 0.0


@triton.jit
def _phase_kernel(buf_ptr, w_ptr, phase, P, TILE: tl.constexpr, USE_PDL: tl.constexpr):
    """One phase as its own launch: buf[next][pid] = buf[cur][(pid + 1) % P] + 1."""
    pid = tl.program_id(0)
    acc = _weight_sum(w_ptr, phase, pid, P, TILE)   # before the wait, like a skinny matmul's weights
    pdl_wait(USE_PDL)
    v = tl.load(buf_ptr + (phase % 2) * P + (pid + 1) % P)
    tl.store(buf_ptr + ((phase + 1) % 2) * P + pid, v + 1.0 + 0.0 * acc)


@triton.jit
def _barrier_kernel(buf_ptr, w_ptr, counter_ptr, P, PHASES: tl.constexpr, TILE: tl.constexpr):
    """All phases in one launch; grid = P programs, all resident. counter starts at 0 and counts arrivals."""
    pid = tl.program_id(0)
    for phase in range(PHASES):
        acc = _weight_sum(w_ptr, phase, pid, P, TILE)   # before the barrier's spin: it overlaps the wait
        if phase > 0:
            target = phase * P   # every program has finished phase - 1
            while tl.atomic_add(counter_ptr, 0, sem="acquire") < target:
                pass
        v = tl.load(buf_ptr + (phase % 2) * P + (pid + 1) % P, cache_modifier=".cg")   # L2: another SM wrote it
        tl.store(buf_ptr + ((phase + 1) % 2) * P + pid, v + 1.0 + 0.0 * acc)
        tl.debug_barrier()                                  # every thread's store precedes the release below
        tl.atomic_add(counter_ptr, 1, sem="release")


def measure(tile: int, phases: int = PHASES, warps: int = 4) -> dict:
    """us per phase for the chain and the barrier versions at one weight tile size; both results checked."""
    dev = torch.device("cuda")
    programs = torch.cuda.get_device_properties(dev).multi_processor_count
    weights = torch.randn(max(phases * programs * tile, 1), device=dev).to(torch.bfloat16)
    buf = torch.zeros(2, programs, device=dev)
    counter = torch.zeros(1, dtype=torch.int32, device=dev)
    pdl = launch_options(dev)

    def chain() -> None:
        for phase in range(phases):
            _phase_kernel[(programs,)](buf, weights, phase, programs, TILE=tile, num_warps=warps, **pdl)

    def barrier() -> None:
        counter.zero_()
        _barrier_kernel[(programs,)](buf, weights, counter, programs, PHASES=phases, TILE=tile, num_warps=warps)

    result = {"tile": tile, "programs": programs, "phases": phases, "warps": warps, "pdl": bool(pdl["USE_PDL"])}
    for name, body in (("chain", chain), ("barrier", barrier)):
        buf.zero_()
        body()                       # compile, and check one run: every value grew by exactly `phases`
        torch.cuda.synchronize()
        final = buf[phases % 2]
        assert torch.equal(final, torch.full_like(final, float(phases))), f"{name}: wrong result {final[:4]}"
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            body()
        result[f"{name}_us_per_phase"] = replay_time_us(graph, REPLAYS) / phases
    result["weight_bytes_per_phase"] = programs * tile * 2
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiles", default="0,4096,16384", help="bf16 weights read per program per phase")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    print("| weights per phase | chain (kernel per phase, PDL) us | barrier (one kernel) us | saved per boundary us |")
    print("|---|---|---|---|")
    for tile in (int(t) for t in args.tiles.split(",")):
        r = measure(tile)
        rows.append(r)
        print(f"| {r['weight_bytes_per_phase'] / 1e6:.2f} MB | {r['chain_us_per_phase']:.2f} | "
              f"{r['barrier_us_per_phase']:.2f} | {r['chain_us_per_phase'] - r['barrier_us_per_phase']:.2f} |",
              flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
