"""All-reduce latency per message size, NCCL against the symmetric-memory road (distributed/custom_all_reduce.py).

One process per GPU (`--world-size N`, default every visible GPU), each joining the tensor-parallel group the way
the engine does (ranks/group.py join_group: NCCL plus the symmetric-memory buffer, checked against NCCL at
open). For each message size (bf16; default 8 KB .. 8 MiB) and road it times:

    graph   a CUDA graph of --graph-ops all-reduces, replayed --replays times: the median replay / ops (decode's
            all-reduces run inside the decode graphs, so this is the figure a TP decode step pays)
    eager   --graph-ops all-reduces launched from Python, the median over --replays groups / ops (host launch
            cost included: prefill and eager decode)

Each time is the slowest rank's (a collective ends when its last rank does). Every road is also run once on small
integers, eagerly and through a one-op graph, and compared with the exact sum (and symm with NCCL's result):
`correct` in the report. A size the symmetric road does not carry (route_for says NCCL: past 2 MiB) is reported
as not applicable. `--device cpu` runs the same over gloo in CPU processes, eager only (a smoke test).

    python -m benchmarks.all_reduce_bench [--world-size N] [--sizes 8K,1M] [--device cuda|cpu] [--out ar.json]

Rank 0 writes the JSON after every size (a run cut short keeps what it measured) and prints one line per size.
"decode_step_8b" estimates what the Llama-3.1-8B decode step spends in all-reduces at bs1: 65 of 8 KB (after
o_proj and down_proj in each of 32 layers, and the vocab-split embedding's). The ranks are child processes of
this one: they exit when it does (their stdin is its pipe), and on an error, a timeout or SIGTERM it kills them.
"""
from __future__ import annotations

import os

# Before torch, NCCL or symmetric memory start here or in any rank (which inherit the environment): no NVLink
# multicast (NVLS), which takes memory per communicator and has hung collectives on these machines' drivers.
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
os.environ.update(SAFE_ENV)

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import platform  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SIZES = "8K,32K,128K,256K,512K,1M,2M,8M"
# The 8B decode step at bs1: hidden 4096 in bf16 per all-reduce, 2 per layer x 32 layers + the embedding's.
STEP_MESSAGE_BYTES = 4096 * 2
STEP_ALL_REDUCES = 2 * 32 + 1


@dataclass(frozen=True, slots=True)
class Spec:
    """What every rank runs; sent to each as one JSON line on its stdin."""
    world_size: int
    device: str          # "cuda" or "cpu"
    sizes: list[int]     # message sizes in bytes
    dtype: str
    graph_ops: int
    replays: int
    port: int
    out: str
    timeout_s: float


def parse_size(text: str) -> int:
    """'8K' -> 8192, '2M' -> 2 MiB, '512' -> 512 bytes."""
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def format_size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KB" if nbytes >= 1024 else f"{nbytes} B"


# ---- one rank ------------------------------------------------------------------------------------------------

class _Keep(logging.Handler):
    """Keeps the distributed logger's lines (why the symmetric road did or did not open) for the report."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _exit_at_eof() -> None:
    """stdin is the starter's pipe: EOF means it is gone, and a rank left alone would wait in a collective."""
    sys.stdin.buffer.read()
    os._exit(1)


class Rank:
    """This process's group and the timing helpers; every method is called by every rank in the same order."""

    def __init__(self, rank: int, spec: Spec) -> None:
        import torch
        import torch.distributed as dist

        from kestrel.ranks.group import Rendezvous, join_group, open_store

        self.torch, self.dist = torch, dist
        self.rank, self.spec = rank, spec
        self.cuda = spec.device == "cuda"
        if not self.cuda:
            torch.set_num_threads(1)   # CPU ranks share the cores: one thread each, or they spin against each other
        self.keep = _Keep()
        dlog = logging.getLogger("kestrel.distributed")
        dlog.setLevel(logging.INFO)
        dlog.addHandler(self.keep)
        rdv = Rendezvous("127.0.0.1", spec.port, spec.world_size, spec.world_size, spec.timeout_s)
        self.store = open_store(rdv, is_master=rank == 0)   # kept: the store lives as long as rank 0 holds it
        # The engine's own join: NCCL (gloo on the CPU), a gloo CPU group, and on CUDA the symmetric buffer
        self.tp = join_group(rdv, rank, self.store, spec.device, custom_all_reduce=True)
        self.device = torch.device("cuda", self.tp.local_rank) if self.cuda else torch.device("cpu")
        self.dtype = getattr(torch, spec.dtype)

    # -- agreement over the gloo CPU group (never the road being timed) --
    def max_over_ranks(self, value: float) -> float:
        t = self.torch.tensor([value], dtype=self.torch.float64)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX, group=self.tp.cpu_group)
        return float(t.item())

    def all_ranks(self, ok: bool) -> bool:
        return self.max_over_ranks(0.0 if ok else 1.0) == 0.0

    def failed_ranks(self, failed: bool) -> int:
        t = self.torch.tensor([1 if failed else 0], dtype=self.torch.int64)
        self.dist.all_reduce(t, group=self.tp.cpu_group)
        return int(t.item())

    def barrier(self) -> None:
        self.dist.barrier(group=self.tp.cpu_group)

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.device)

    # -- the roads --
    def roads(self) -> dict[str, Callable]:
        dist, group = self.dist, self.tp.device_group
        roads: dict[str, Callable] = {self.backend: lambda x: dist.all_reduce(x, group=group)}
        if self.tp.fast_all_reduce is not None:
            roads["symm"] = self.tp.fast_all_reduce.all_reduce
        return roads

    @property
    def backend(self) -> str:
        return "nccl" if self.cuda else "gloo"

    # -- timing --
    def time_eager(self, op: Callable, x, ops: int, replays: int) -> float:
        """µs per all-reduce: the median over `replays` groups of `ops` back-to-back launches."""
        for _ in range(3):
            op(x)
        self.sync()
        self.barrier()
        if not self.cuda:
            times = []
            for _ in range(replays):
                t0 = time.perf_counter()
                for _ in range(ops):
                    op(x)
                times.append(time.perf_counter() - t0)
            return 1e6 * statistics.median(times) / ops
        events = [self.torch.cuda.Event(enable_timing=True) for _ in range(replays + 1)]
        events[0].record()
        for i in range(replays):
            for _ in range(ops):
                op(x)
            events[i + 1].record()
        self.sync()
        # the first group also absorbs the ranks' skew at the start; the median leaves it out
        return 1000 * statistics.median(a.elapsed_time(b) for a, b in zip(events, events[1:])) / ops

    def capture(self, op: Callable, x, ops: int):
        """A CUDA graph of `ops` all-reduces of x (warmed up on a side stream first, as capture requires)."""
        torch = self.torch
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(3):
                op(x)
        torch.cuda.current_stream(self.device).wait_stream(side)
        self.sync()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(ops):
                op(x)
        return graph

    def time_graph(self, op: Callable, x, ops: int, replays: int) -> float:
        """µs per all-reduce inside a captured graph: the median replay / ops."""
        graph = self.capture(op, x, ops)
        self.barrier()
        graph.replay()
        self.sync()
        self.barrier()
        events = [self.torch.cuda.Event(enable_timing=True) for _ in range(replays + 1)]
        events[0].record()
        for i in range(replays):
            graph.replay()
            events[i + 1].record()
        self.sync()
        del graph
        return 1000 * statistics.median(a.elapsed_time(b) for a, b in zip(events, events[1:])) / ops

    # -- correctness --
    def small_ints(self, numel: int):
        """This rank's input: (i mod 7) + rank, exact in bf16 however the sum is ordered; and the exact sum."""
        torch, n = self.torch, self.spec.world_size
        i = torch.arange(numel, device=self.device) % 7
        return (i + self.rank).to(self.dtype), (i * n + n * (n - 1) // 2).to(self.dtype)

    def check(self, op: Callable, numel: int) -> tuple[bool, Any]:
        """Eager, and (on CUDA) through a one-op graph: both equal the exact sum. Returns (ok, the eager result)."""
        x, want = self.small_ints(numel)
        got = x.clone()
        op(got)
        self.sync()
        ok = bool(self.torch.equal(got, want))
        if self.cuda:
            static = x.clone()
            graph = self.capture(op, static, 1)
            static.copy_(x)
            self.barrier()
            graph.replay()
            self.sync()
            ok = ok and bool(self.torch.equal(static, want))
            del graph
        return ok, got


def measure_size(r: Rank, nbytes: int) -> dict:
    """Every road at one message size: times, correctness, or why the road does not apply."""
    from kestrel.distributed.custom_all_reduce import route_for

    torch, spec = r.torch, r.spec
    numel = nbytes // r.dtype.itemsize
    fast = r.tp.fast_all_reduce
    route = route_for(numel, r.dtype, spec.world_size, fast.max_bytes) if fast is not None else None
    entry: dict[str, Any] = {"bytes": nbytes, "numel": numel, "route": route.kind if route else r.backend,
                             "roads": {}}
    if fast is None and r.cuda:
        entry["roads"]["symm"] = {"applicable": False, "reason": "the symmetric-memory all-reduce did not open"}
    reference = None
    for name, op in r.roads().items():
        if name == "symm" and route.kind == "nccl":
            entry["roads"][name] = {"applicable": False, "reason": f"routed to NCCL: {route.reason}"}
            continue
        error = None
        ok, match, eager, graph = False, None, 0.0, None
        try:   # this rank's part; the ranks agree on the outcome below, outside the try
            ok, got = r.check(op, numel)
            if name == r.backend:
                reference = got
            elif reference is not None:
                match = bool(torch.equal(got, reference))
            x = torch.zeros(numel, dtype=r.dtype, device=r.device)   # zeros: sums never overflow over many ops
            eager = r.time_eager(op, x, spec.graph_ops, spec.replays)
            graph = r.time_graph(op, x, spec.graph_ops, spec.replays) if r.cuda else None
        except Exception as exc:   # noqa: BLE001 - recorded; the ranks then decide together whether to go on
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
        failed = r.failed_ranks(error is not None)
        if failed:
            if failed < spec.world_size:
                # only some ranks failed: the others may have left collectives waiting on them, so stop here
                raise RuntimeError(f"{name} at {nbytes} bytes failed on {failed} of {spec.world_size} ranks"
                                   f"{f' ({error})' if error else ''}")
            res: dict[str, Any] = {"error": error}
        else:
            res = {"correct": r.all_ranks(ok), "eager_us": r.max_over_ranks(eager),
                   "graph_us": r.max_over_ranks(graph) if graph is not None else None}
            if match is not None:
                res["matches_nccl"] = r.all_ranks(match)
        entry["roads"][name] = res
    return entry


def step_estimate(sizes: list[dict]) -> dict:
    """The 8B decode step's all-reduce time per road and mode, from the 8 KB row."""
    row = next((s for s in sizes if s["bytes"] == STEP_MESSAGE_BYTES), None)
    per_step: dict[str, float] = {}
    for name, res in (row or {}).get("roads", {}).items():
        for mode in ("graph", "eager"):
            us = res.get(f"{mode}_us")
            if us:
                per_step[f"{name}_{mode}"] = STEP_ALL_REDUCES * us
    return {"all_reduces": STEP_ALL_REDUCES, "message_bytes": STEP_MESSAGE_BYTES, "us_per_step": per_step,
            "note": "Llama-3.1-8B bs1 decode: 2 all-reduces a layer x 32 layers + the embedding's, 8 KB each"}


def describe(entry: dict) -> str:
    parts = [f"{format_size(entry['bytes']):>7} {entry['route']:>8}"]
    for name, res in entry["roads"].items():
        if not res.get("applicable", True):
            parts.append(f"{name} n/a")
        elif "error" in res:
            parts.append(f"{name} error: {res['error']}")
        else:
            graph = f"graph {res['graph_us']:.1f} " if res.get("graph_us") else ""
            ok = "ok" if res.get("correct") and res.get("matches_nccl", True) else "WRONG"
            parts.append(f"{name} {graph}eager {res['eager_us']:.1f} us {ok}")
    return " | ".join(parts)


def write_atomic(path: Path, report: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1))
    tmp.replace(path)


def rank_main(rank: int) -> None:
    spec = Spec(**json.loads(sys.stdin.buffer.readline()))
    threading.Thread(target=_exit_at_eof, name="parent-watch", daemon=True).start()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s %(name)s[rank {rank}]: %(message)s")
    logging.getLogger().handlers[0].setLevel(logging.WARNING)   # the INFO lines go to the report (_Keep), not here
    code = 0
    try:
        r = Rank(rank, spec)
        torch = r.torch
        report: dict[str, Any] = {
            "world_size": spec.world_size, "device": spec.device, "backend": r.backend, "dtype": spec.dtype,
            "gpu": torch.cuda.get_device_name(r.device) if r.cuda else platform.processor() or "cpu",
            "torch": torch.__version__, "graph_ops": spec.graph_ops, "replays": spec.replays,
            "env": {k: os.environ.get(k) for k in SAFE_ENV},
            "symm_open": r.tp.fast_all_reduce is not None, "symm_log": r.keep.lines[-4:],
            "timing": "us per all-reduce, the slowest rank's median", "sizes": [], "complete": False}
        if rank == 0:
            print(f"all-reduce bench: {spec.world_size} x {report['gpu']}, {r.backend}"
                  f"{', symmetric memory on' if report['symm_open'] else ''}, torch {torch.__version__}", flush=True)
        for nbytes in spec.sizes:
            entry = measure_size(r, nbytes)
            report["sizes"].append(entry)
            report["decode_step_8b"] = step_estimate(report["sizes"])
            if rank == 0:
                print(describe(entry), flush=True)
                write_atomic(Path(spec.out), report)
        report["correct"] = all(res.get("correct", True) and res.get("matches_nccl", True)
                                for s in report["sizes"] for res in s["roads"].values()
                                if res.get("applicable", True))
        report["complete"] = True
        if rank == 0:
            write_atomic(Path(spec.out), report)
            step = report["decode_step_8b"]["us_per_step"]
            print("8B decode step, all-reduce us: " + ", ".join(f"{k} {v:.0f}" for k, v in step.items()), flush=True)
        r.barrier()
    except Exception:   # noqa: BLE001 - said in this rank's stderr; the starter sees the exit code
        logging.getLogger("all_reduce_bench").exception("rank %d failed", rank)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)   # not a normal exit: the stdin thread blocked in read() would make interpreter shutdown abort


# ---- the starter -----------------------------------------------------------------------------------------------

class RanksFailed(Exception):
    pass


def run_ranks(spec: Spec, timeout_s: float) -> None:
    """Start spec.world_size rank processes and wait; any failure, the timeout or SIGTERM kills them all."""
    env = {**os.environ, **SAFE_ENV, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                                                os.environ.get("PYTHONPATH")]))}
    procs: list[subprocess.Popen] = []

    def on_term(signum, frame):   # the finally below kills the ranks
        raise RanksFailed(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        line = (json.dumps(asdict(spec)) + "\n").encode()
        for rank in range(spec.world_size):
            proc = subprocess.Popen([sys.executable, "-m", "benchmarks.all_reduce_bench", "--rank", str(rank)],
                                    stdin=subprocess.PIPE, cwd=ROOT, env=env)
            proc.stdin.write(line)
            proc.stdin.flush()   # and left open: EOF tells the rank to exit
            procs.append(proc)
        deadline = time.monotonic() + timeout_s
        while True:
            codes = [p.poll() for p in procs]
            bad = [(rank, c) for rank, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                raise RanksFailed(", ".join(f"rank {rank} exited with code {c}" for rank, c in bad))
            if all(c == 0 for c in codes):
                return
            if time.monotonic() > deadline:
                raise RanksFailed(f"timed out after {timeout_s:g} s")
            time.sleep(0.1)
    finally:
        signal.signal(signal.SIGTERM, previous)
        stop(procs)


def stop(procs: list[subprocess.Popen], grace_s: float = 5.0) -> None:
    """Close each rank's stdin (it exits at EOF), then kill what is still there after grace_s."""
    for p in procs:
        try:
            p.stdin.close()
        except OSError:
            pass
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-size", type=int, default=None, help="ranks (default: every visible GPU; 2 on the CPU)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cuda: NCCL and symmetric memory, one GPU a rank; cpu: gloo in CPU processes (a smoke test)")
    ap.add_argument("--sizes", default=DEFAULT_SIZES, help=f"message sizes, bytes with K/M suffixes (default "
                    f"{DEFAULT_SIZES}); 8K, the 8B decode step's message, is always included")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--graph-ops", type=int, default=50, help="all-reduces per captured graph (and per eager group)")
    ap.add_argument("--replays", type=int, default=10, help="timed graph replays (and eager groups); the median")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds for the whole run; then the ranks are "
                    "killed and the report says so")
    ap.add_argument("--out", default="all_reduce.json")
    ap.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)   # a rank process (this module)
    args = ap.parse_args(argv)
    if args.rank is not None:
        rank_main(args.rank)   # does not return
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device is visible (--device cpu runs gloo on the CPU)")
    world = args.world_size or (torch.cuda.device_count() if args.device == "cuda" else 2)
    if world < 1 or (args.device == "cuda" and world > torch.cuda.device_count()):
        ap.error(f"--world-size {world}: {torch.cuda.device_count() if args.device == 'cuda' else 'any'} "
                 "GPU(s) visible")
    try:
        sizes = sorted({parse_size(s) for s in args.sizes.split(",") if s.strip()} | {STEP_MESSAGE_BYTES})
    except ValueError:
        ap.error(f"--sizes {args.sizes!r}: expected sizes like 8K,256K,2M")
    itemsize = getattr(torch, args.dtype).itemsize
    if any(s <= 0 or s % itemsize for s in sizes):
        ap.error(f"--sizes: every size must be a positive multiple of {itemsize} bytes ({args.dtype})")
    from kestrel.ranks.group import free_port

    out = Path(args.out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)
    spec = Spec(world, args.device, sizes, args.dtype, args.graph_ops, args.replays, free_port(), str(out),
                min(args.timeout, 120.0))
    try:
        run_ranks(spec, args.timeout)
    except (RanksFailed, KeyboardInterrupt) as exc:
        report = json.loads(out.read_text()) if out.is_file() else {"world_size": world, "device": args.device,
                                                                    "sizes": []}
        report.update(complete=False, error=str(exc) or type(exc).__name__)
        write_atomic(out, report)
        print(f"all-reduce bench failed: {report['error']}; {len(report['sizes'])} size(s) in {out}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
