"""Where a cold start's seconds go, kernel by kernel: the engine's startup (kestrel/forward/startup.py build_runner)
in this process with every compile cache empty, every Triton and NVRTC compile timed and charged to the startup
phase it ran in.

    python -m benchmarks.startup_profile MODEL [--device cuda] [--out startup.json] [--cprofile]

Writes JSON: the phases' seconds, each compile (kind, kernel, phase, seconds, the constexprs that made it a new
variant), the compile seconds per phase and per kernel, and with --cprofile the 40 functions of most cumulative time.
cold_start.py times the same phases through `kestrel serve`; this says what is inside them.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from benchmarks.cold_start import cold_environment


class CompileLog:
    """Wraps the compilers (Triton's `compile`, Kestrel's NVRTC `compile_cubin`) to time each call."""

    def __init__(self) -> None:
        self.phase = "starting"
        self.records: list[dict] = []

    def wrap(self, kind: str, fn, describe):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                name, variant = describe(*args, **kwargs)
                self.records.append({"kind": kind, "kernel": name, "phase": self.phase, "variant": variant,
                                     "s": round(time.perf_counter() - start, 4)})
        return timed

    def install(self) -> None:
        import triton.compiler
        from kestrel.kernels.cuda import cuda_rtc

        def triton_name(src, *args, **kwargs):
            fn = getattr(src, "fn", None)
            constants = getattr(src, "constants", {}) or {}
            return getattr(fn, "__name__", str(src)), {str(k): str(v) for k, v in constants.items()}
        # JITFunction takes `compile` from triton.compiler when it first builds its binder (after this runs)
        triton.compiler.compile = self.wrap("triton", triton.compiler.compile, triton_name)
        cuda_rtc.compile_cubin = self.wrap("nvrtc", cuda_rtc.compile_cubin,
                                           lambda source, name, arch, defines: (name, {k: str(v) for k, v in
                                                                                       defines.items()}))

    def summary(self) -> dict:
        by_phase: dict[str, float] = defaultdict(float)
        by_kernel: dict[str, list] = defaultdict(lambda: [0, 0.0])
        for r in self.records:
            by_phase[r["phase"]] += r["s"]
            entry = by_kernel[f'{r["kind"]}:{r["kernel"]}']
            entry[0] += 1
            entry[1] += r["s"]
        kernels = sorted(({"kernel": k, "compiles": n, "s": round(s, 2)} for k, (n, s) in by_kernel.items()),
                         key=lambda e: -e["s"])
        return {"compiles": len(self.records), "compile_s": round(sum(r["s"] for r in self.records), 2),
                "compile_s_by_phase": {k: round(v, 2) for k, v in by_phase.items()}, "by_kernel": kernels}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--cprofile", action="store_true", help="also profile the startup with cProfile (slower)")
    ap.add_argument("--warm", action="store_true", help="keep this machine's compile caches (a warm start)")
    args = ap.parse_args()
    if not args.warm:   # before torch or triton are imported: they read the cache locations once
        os.environ.update(cold_environment(Path(tempfile.mkdtemp(prefix="kestrel-startup-"))))

    t0 = time.monotonic()
    from kestrel.config import EngineConfig
    from kestrel.forward.startup import build_runner
    from kestrel.progress import Progress
    import_s = time.monotonic() - t0

    log = CompileLog()
    log.install()
    progress = Progress()
    begin = progress.begin

    def begin_and_note(phase, *a, **kw):
        log.phase = phase
        begin(phase, *a, **kw)
    progress.begin = begin_and_note
    profiler = cProfile.Profile() if args.cprofile else None
    start = time.monotonic()
    if profiler:
        profiler.enable()
    setup = build_runner(EngineConfig(model=args.model, device=args.device), progress)
    if profiler:
        profiler.disable()
    progress.ready()
    report = {"model": args.model, "device": args.device, "import_s": round(import_s, 2),
              "build_runner_s": round(time.monotonic() - start, 2),
              "phases_s": {k: round(v, 2) for k, v in progress.phase_durations.items()},
              "caches": "warm" if args.warm else "empty", **log.summary(), "records": log.records}
    graphs = setup.runner.graphs
    if graphs is not None:
        report["graph_memory_gib"] = round(graphs.memory_bytes / 2**30, 3)
        report["cuda_graph_max_bs"] = getattr(graphs, "max_bs", None)   # the capture size it was measured at
    if profiler:
        stats = pstats.Stats(profiler)
        rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][3])[:40]
        report["cprofile_top"] = [{"fn": f"{Path(f).name}:{line}:{name}", "calls": nc, "cum_s": round(ct, 2),
                                   "self_s": round(tt, 2)} for (f, line, name), (cc, nc, tt, ct, _) in rows]
    text = json.dumps(report, indent=1)
    if args.out:
        args.out.write_text(text)
    short = {k: v for k, v in report.items() if k not in ("records", "cprofile_top")}
    short["by_kernel"] = report["by_kernel"][:15]
    print(json.dumps(short, indent=1), file=sys.stderr)


if __name__ == "__main__":
    main()
