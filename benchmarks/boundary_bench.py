"""What a chain of dependent phases costs on this GPU: a kernel per phase (PDL) against one kernel with grid
barriers, and what streaming weights ahead of the chain buys in each.

The 0.6B bs1 decode step is a chain of 168 dependent kernels whose weights need ~1.8 us each at copy bandwidth
while each costs ~3.5 us exposed (BENCHMARKS.md, sessions 8-9). This runs the same PHASES phases of the same work
several ways:

    chain     PHASES launches of _phase_kernel (with PDL on Hopper, as the decode kernels), in one CUDA graph:
              issue this phase's weight loads, pdl_wait, read the neighbour's value the previous launch wrote,
              sum the weights, write our own. A kernel's registers die with it, so weights are in flight at most
              one phase ahead: the next kernel launches only after this one's wait.
    chain_l2  the same chain, plus a prefetch kernel on a second stream (forked and joined inside the graph):
              PREFETCHERS programs that issue `prefetch.global.L2` for phase p's weights once the chain has
              reached phase p - LEAD (program 0 of each phase kernel publishes its phase after its wait). Asks
              whether weights already in L2 shorten a phase.
    barrier   one launch of _barrier_kernel, one program per SM (all co-resident): the same phases, each ending
              in a grid barrier (CTA barrier, release atomic add on one counter); the phase's weight loads are
              issued before every program spins on an acquire load until all arrived, and summed after.
    barrier2  the barrier kernel with DEPTH=2: phase p + 1's weight loads are issued before the spin that ends
              phase p, so two phases of weights are in flight: what a persistent kernel can do and a chain of
              launches cannot.

A second table (--matvec) asks what a skinny matmul's own work after the wait costs: MV_PROGRAMS programs each hold
MV_ROWS rows of a [MV_K, MV_K] bf16 weight (8 KB a program, 2 MB a phase, read before the wait), and after it
    plain     read one value the previous phase wrote, store: the phase's floor at these weights
    mv        read the whole x vector (2 KB) the previous phase wrote, one row-sum of w * x per row, store the rows:
              the 0.6B's o_proj / down epilogue; every program reads the same 16 lines of x
    mv_rep    the same, but each phase stores its output MV_REPLICAS times and program pid reads copy pid % REPS:
              whether 256 programs reading the same lines is what costs
(w is 1 / MV_K everywhere and x starts at 1, so every output is exactly 1 and checked.)

Per phase every program reads TILE bf16 weights (0: none; the 0.6B's matmuls read 8-16K a program) and one value
written by another program in the phase before, so each phase truly depends on the whole previous one. Every
result is checked: after PHASES phases every value has grown by exactly PHASES.

    python -m benchmarks.boundary_bench --out /tmp/boundary.json
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from benchmarks import write_json
from benchmarks.gemv_bench import replay_time_us
from kestrel.layers.pdl import launch_options, pdl_wait

PHASES = 168        # the 0.6B's dependent launches per decode step (6 per layer x 28)
REPLAYS = 20
PREFETCHERS = 32    # programs of the L2 prefetch kernel (one per SM they land on, beside the chain's)
LINE = 64           # bf16 elements per 128-byte L2 line
MV_PROGRAMS, MV_ROWS, MV_K = 256, 4, 1024   # the 0.6B's o_proj grid, square: each phase's N is the next one's K
MV_REPLICAS = 8
SPIN_BUDGET = 20_000   # polls of the chain's progress per prefetch program before it stops waiting (~15 ms)


@triton.jit
def _weight_tile(w_ptr, phase, pid, P, TILE: tl.constexpr, mask=True):
    """This program's weight tile for `phase` (loads issued, not waited on); a dummy when TILE == 0."""
    if TILE > 0:
        offs = tl.arange(0, TILE)
        w = tl.load(w_ptr + (phase * P + pid).to(tl.int64) * TILE + offs, mask=mask, other=0.0)
    else:
        w = tl.zeros([1], tl.bfloat16)
    return w


@triton.jit
def _phase_kernel(buf_ptr, w_ptr, progress_ptr, phase, P, TILE: tl.constexpr, PUBLISH: tl.constexpr,
                  USE_PDL: tl.constexpr):
    """One phase as its own launch: buf[next][pid] = buf[cur][(pid + 1) % P] + 1."""
    pid = tl.program_id(0)
    w = _weight_tile(w_ptr, phase, pid, P, TILE)   # before the wait, like a skinny matmul's weights
    pdl_wait(USE_PDL)
    if PUBLISH:   # for the L2 prefetcher: the chain has reached this phase
        tl.store(progress_ptr, phase, mask=pid == 0)
    v = tl.load(buf_ptr + (phase % 2) * P + (pid + 1) % P)
    tl.store(buf_ptr + ((phase + 1) % 2) * P + pid, v + 1.0 + 0.0 * tl.sum(w.to(tl.float32), 0))


@triton.jit
def _prefetch_lines_l2(ptrs):
    """`prefetch.global.L2` of the 128-byte line at each pointer (no data comes back to the SM)."""
    return tl.inline_asm_elementwise("mov.u32 $0, 0;\n\tprefetch.global.L2 [$1];", "=r,l", [ptrs],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _l2_prefetch_kernel(w_ptr, progress_ptr, P, PHASES: tl.constexpr, LEAD: tl.constexpr, TILE: tl.constexpr,
                        PROGRAMS: tl.constexpr, LINES: tl.constexpr, SPIN_BUDGET: tl.constexpr):
    """Program pid prefetches lines pid, pid + PROGRAMS, ... of each phase's weights into L2, phase p as soon as
    the chain has published phase p - LEAD. progress_ptr[0]: the chain's phase; [1 + pid]: how many times this
    program polled it.

    Nothing guarantees that two branches of a CUDA graph run at the same time, so the polls are bounded: once
    SPIN_BUDGET are spent the program stops waiting (prefetches become early, never a hang), and the poll count
    it leaves behind says whether that happened."""
    pid = tl.program_id(0)
    lines = (pid + PROGRAMS * tl.arange(0, LINES)).to(tl.int64)
    lines = tl.where(lines < P * TILE // 64, lines, pid)   # spare lanes prefetch a line again: harmless
    sink = tl.zeros([LINES], tl.int32)
    polls = 0
    for phase in range(1, PHASES):
        while (tl.load(progress_ptr, volatile=True) < phase - LEAD) & (polls < SPIN_BUDGET):
            polls += 1
        sink += _prefetch_lines_l2(w_ptr + (phase * P).to(tl.int64) * TILE + lines * 64)
    tl.store(progress_ptr + 1 + pid, polls + tl.sum(sink, 0))   # the asm results are 0


@triton.jit
def _barrier_kernel(buf_ptr, w_ptr, counter_ptr, P, PHASES: tl.constexpr, TILE: tl.constexpr,
                    DEPTH: tl.constexpr):
    """All phases in one launch; grid = P programs, all resident. counter starts at 0 and counts arrivals.
    DEPTH 1: a phase's weight loads are issued just before its barrier spin; 2: a phase ahead of that."""
    pid = tl.program_id(0)
    w_next = _weight_tile(w_ptr, 0, pid, P, TILE)
    for phase in range(PHASES):
        if DEPTH == 2:
            w = w_next
            w_next = _weight_tile(w_ptr, phase + 1, pid, P, TILE, mask=phase + 1 < PHASES)
        else:
            w = _weight_tile(w_ptr, phase, pid, P, TILE)
        if phase > 0:
            target = phase * P   # every program has finished phase - 1
            while tl.atomic_add(counter_ptr, 0, sem="acquire") < target:
                pass
        v = tl.load(buf_ptr + (phase % 2) * P + (pid + 1) % P, cache_modifier=".cg")   # L2: another SM wrote it
        tl.store(buf_ptr + ((phase + 1) % 2) * P + pid, v + 1.0 + 0.0 * tl.sum(w.to(tl.float32), 0))
        tl.debug_barrier()                                  # every thread's store precedes the release below
        tl.atomic_add(counter_ptr, 1, sem="release")


@triton.jit
def _matvec_phase_kernel(x_ptr, w_ptr, phase, ROWS: tl.constexpr, K: tl.constexpr, MODE: tl.constexpr,
                         REPS: tl.constexpr, USE_PDL: tl.constexpr):
    """Phase `phase` of a chain of [K, K] matvecs (x_ptr: [2, REPS, K] bf16, x[cur] -> x[next]); program pid owns
    rows pid * ROWS ... MODE 0: plain (one value read, no matvec); 1: the matvec; REPS copies of the output."""
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    ks = tl.arange(0, K)
    w = tl.load(w_ptr + phase * (K * K) + rows[:, None] * K + ks[None, :])   # before the wait (< 2**31)
    pdl_wait(USE_PDL)
    cur = x_ptr + (phase % 2) * REPS * K + (pid % REPS) * K
    nxt = x_ptr + ((phase + 1) % 2) * REPS * K
    if MODE == 0:
        v = tl.load(cur + (rows + ROWS) % K).to(tl.float32)                             # the neighbour's rows
        out = v + 0.0 * tl.sum(w.to(tl.float32), 1)
    else:
        x = tl.load(cur + ks).to(tl.float32)
        out = tl.sum(w.to(tl.float32) * x[None, :], 1)
    for r in tl.static_range(REPS):
        tl.store(nxt + r * K + rows, out.to(tl.bfloat16))


def checked_us_per_phase(body: Callable[[], None], check: Callable[[], None], phases: int) -> float:
    """Run body once (compiling its kernels) and check the result, then capture it in a CUDA graph and time it:
    us per phase."""
    body()
    torch.cuda.synchronize()
    check()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    return replay_time_us(graph, REPLAYS) / phases


def measure_matvec(phases: int = PHASES) -> dict:
    """us per phase of the matvec-epilogue variants (module docstring); every result checked."""
    dev = torch.device("cuda")
    pdl = launch_options(dev)
    weights = torch.full((phases, MV_K, MV_K), 1.0 / MV_K, device=dev, dtype=torch.bfloat16)
    result = {"programs": MV_PROGRAMS, "rows": MV_ROWS, "k": MV_K, "phases": phases,
              "weight_bytes_per_phase": MV_K * MV_K * 2}
    for name, mode, reps in (("plain", 0, 1), ("mv", 1, 1), ("mv_rep", 1, MV_REPLICAS)):
        print(f"  matvec: {name}", file=sys.stderr, flush=True)
        x = torch.ones(2, reps, MV_K, device=dev, dtype=torch.bfloat16)

        def body() -> None:
            for phase in range(phases):
                _matvec_phase_kernel[(MV_PROGRAMS,)](x, weights, phase, ROWS=MV_ROWS, K=MV_K, MODE=mode, REPS=reps,
                                                     num_warps=4, **pdl)
        def check() -> None:
            assert torch.equal(x, torch.ones_like(x)), f"{name}: wrong result"
        x[1].zero_()   # phase 0 reads x[0] and writes x[1]: every copy of both must come out 1
        result[f"{name}_us_per_phase"] = checked_us_per_phase(body, check, phases)
    return result


def measure(tile: int, leads: list[int], phases: int = PHASES) -> dict:
    """us per phase of every variant at one weight tile size; every result checked."""
    dev = torch.device("cuda")
    programs = torch.cuda.get_device_properties(dev).multi_processor_count
    warps = 8 if tile > 16384 else 4   # two 32K tiles in flight fit in registers at 8 warps
    weights = torch.randn(max(phases * programs * tile, 1), device=dev).to(torch.bfloat16)
    buf = torch.zeros(2, programs, device=dev)
    counter = torch.zeros(1, dtype=torch.int32, device=dev)
    progress = torch.zeros(1 + PREFETCHERS, dtype=torch.int32, device=dev)
    side = torch.cuda.Stream(dev)
    pdl = launch_options(dev)
    lines = triton.next_power_of_2(triton.cdiv(programs * tile // LINE, PREFETCHERS))

    def chain(publish: bool = False) -> None:
        for phase in range(phases):
            _phase_kernel[(programs,)](buf, weights, progress, phase, programs, TILE=tile, PUBLISH=publish,
                                       num_warps=warps, **pdl)

    def chain_l2(lead: int) -> None:
        progress.zero_()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            _l2_prefetch_kernel[(PREFETCHERS,)](weights, progress, programs, PHASES=phases, LEAD=lead, TILE=tile,
                                                PROGRAMS=PREFETCHERS, LINES=lines, SPIN_BUDGET=SPIN_BUDGET,
                                                num_warps=4)
        chain(publish=True)
        torch.cuda.current_stream().wait_stream(side)

    def barrier(depth: int) -> None:
        counter.zero_()
        _barrier_kernel[(programs,)](buf, weights, counter, programs, PHASES=phases, TILE=tile, DEPTH=depth,
                                     num_warps=warps)

    variants = {"chain": chain, "barrier": lambda: barrier(1), "barrier2": lambda: barrier(2)}
    if tile > 0:
        variants.update({f"chain_l2_lead{lead}": (lambda lead=lead: chain_l2(lead)) for lead in leads})
    result = {"tile": tile, "programs": programs, "phases": phases, "warps": warps, "pdl": bool(pdl["USE_PDL"]),
              "weight_bytes_per_phase": programs * tile * 2}
    def grew_by_phases() -> None:   # every value grew by exactly `phases`
        final = buf[phases % 2]
        assert torch.equal(final, torch.full_like(final, float(phases))), f"wrong result {final[:4]}"

    for name, body in variants.items():
        print(f"  tile {tile}: {name}", file=sys.stderr, flush=True)   # which one, should a kernel hang
        buf.zero_()
        result[f"{name}_us_per_phase"] = checked_us_per_phase(body, grew_by_phases, phases)
        if name.startswith("chain_l2"):   # the last replay's polls: at the budget means the branches ran apart
            result[f"{name}_max_polls"] = int(progress[1:].max())
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiles", default="0,4096,16384,32768", help="bf16 weights read per program per phase")
    ap.add_argument("--leads", default="2,4", help="phases the L2 prefetcher runs ahead of the chain")
    ap.add_argument("--matvec", action="store_true", help="also the matvec-epilogue table")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    leads = [int(x) for x in args.leads.split(",")]
    names = ["chain"] + [f"chain_l2_lead{lead}" for lead in leads] + ["barrier", "barrier2"]
    rows = []
    print("| weights per phase | " + " | ".join(f"{n} us" for n in names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for tile in (int(t) for t in args.tiles.split(",")):
        r = measure(tile, leads)
        rows.append(r)
        cells = [f"{r[f'{n}_us_per_phase']:.2f}" if f"{n}_us_per_phase" in r else "—" for n in names]
        print(f"| {r['weight_bytes_per_phase'] / 1e6:.2f} MB | " + " | ".join(cells) + " |", flush=True)
    if args.matvec:
        mv = measure_matvec()
        rows.append(mv)
        print("\n| 2 MB a phase, 256 programs x 4 rows | plain us | mv us | mv_rep us |\n|---|---|---|---|")
        print(f"| per phase | {mv['plain_us_per_phase']:.2f} | {mv['mv_us_per_phase']:.2f} | "
              f"{mv['mv_rep_us_per_phase']:.2f} |", flush=True)
    write_json(args.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
