"""Startup progress: named phases with a done/total counter, logged with rate and ETA.

Every long step (resolving the model, loading weights, allocating the KV cache, capturing CUDA graphs, warming
up) reports through a Progress, so a slow start never looks like a hang. The server subclasses it to serve the
current phase on /health and to run a stall watchdog.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
import traceback
from typing import Callable

logger = logging.getLogger("kestrel.startup")

PHASES = ("starting_ranks", "resolving_model", "loading_weights", "loading_drafter", "compiling_kernels", "allocating_kv_cache", "capturing_cuda_graphs",
          "warming_up", "loading_tokenizer", "ready")


def _fmt(value: float, unit: str) -> str:
    if unit == "B":
        return f"{value / 1e9:.2f} GB" if value >= 1e8 else f"{value / 1e6:.1f} MB"
    return f"{value:.0f}{(' ' + unit) if unit else ''}"


class Progress:
    """Thread-safe phase tracker; log_interval_s throttles the per-update log lines. `clock` (seconds, monotonic)
    is time.monotonic; tests pass a fake one. `log`: where the lines go (default kestrel.startup); `detail`, when
    set, is appended to the next lines (a training loss) and cleared by begin()."""

    def __init__(self, log_interval_s: float = 1.0, clock: Callable[[], float] = time.monotonic,
                 log: logging.Logger | None = None) -> None:
        self._lock = threading.Lock()
        self._log = log or logger
        self.detail = ""
        self.clock = clock
        self.log_interval_s = log_interval_s
        self.start_time = clock()
        self.phase = "starting"
        self.total: float | None = None
        self.done = 0.0
        self.unit = ""
        self.phase_start = self.start_time
        self.last_progress_time = self.start_time   # the stall watchdog reads this
        self._last_log = 0.0
        self.phase_durations: dict[str, float] = {}

    def begin(self, phase: str, total: float | None = None, unit: str = "") -> None:
        with self._lock:
            now = self.clock()
            # summed: a phase may come back (graph capture runs once per family of graphs)
            self.phase_durations[self.phase] = self.phase_durations.get(self.phase, 0.0) + now - self.phase_start
            self.phase, self.total, self.done, self.unit = phase, total, 0.0, unit
            self.phase_start = self.last_progress_time = now
            self._last_log = now
            self.detail = ""
        total_s = f" ({_fmt(total, unit)})" if total else ""
        self._log.info("phase: %s%s", phase.replace("_", " "), total_s)

    def update(self, done: float) -> None:
        with self._lock:
            now = self.clock()
            self.done = done
            self.last_progress_time = now
            if now - self._last_log < self.log_interval_s and not (self.total and done >= self.total):
                return
            self._last_log = now
            line = self._describe(now)
        self._log.info(line)

    def ready(self) -> None:
        self.begin("ready")

    def fraction(self) -> float | None:
        if self.phase == "ready":
            return 1.0
        if not self.total:
            return None
        return min(1.0, self.done / self.total)

    def elapsed_s(self) -> float:
        return self.clock() - self.start_time

    def _describe(self, now: float) -> str:
        spent = max(now - self.phase_start, 1e-9)
        rate = self.done / spent
        text = f"{self.phase.replace('_', ' ')} {_fmt(self.done, self.unit)}"
        if self.total:
            text += f"/{_fmt(self.total, self.unit)}"
        text += f", {_fmt(rate, self.unit)}/s"
        if self.total and rate > 0:
            text += f", ETA {max(self.total - self.done, 0) / rate:.0f} s"
        if self.detail:
            text += f", {self.detail}"
        return text


def format_all_stacks() -> str:
    """Every live thread's Python stack, like faulthandler.dump_traceback but into a string for the log."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        stack = "".join(traceback.format_stack(frame))
        parts.append(f"--- thread {names.get(ident, '?')} ({ident}) ---\n{stack}")
    return "\n".join(parts)


def descendant_cpu_seconds(root: int | None = None) -> float:
    """CPU time (user + system, reaped children included) of every process below `root` (default: this one),
    read from /proc; 0.0 where /proc is not there."""
    root = os.getpid() if root is None else root
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    children: dict[int, list[int]] = {}
    cpu: dict[int, float] = {}
    try:
        pids = [int(d) for d in os.listdir("/proc") if d.isdigit()]
    except OSError:
        return 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue   # exited meanwhile
        ppid = int(fields[1])
        children.setdefault(ppid, []).append(pid)
        cpu[pid] = sum(int(x) for x in fields[11:15]) / ticks   # utime stime cutime cstime
    total, todo = 0.0, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        total += cpu.get(pid, 0.0)
        todo += children.get(pid, [])
    return total


class ChildCpuWatch:
    """One reading of the children's CPU seconds per poll(), reported as the phase's progress when it grew by more
    than 0.1 s since the last report. `cpu_seconds` is descendant_cpu_seconds; tests pass a scripted one."""

    def __init__(self, progress: Progress, cpu_seconds: Callable[[], float] = descendant_cpu_seconds) -> None:
        self.progress, self.cpu_seconds = progress, cpu_seconds
        self.base = cpu_seconds()
        self.last = 0.0

    def poll(self) -> None:
        used = self.cpu_seconds() - self.base
        if used > self.last + 0.1:
            self.last = used
            self.progress.update(used)


@contextlib.contextmanager
def child_cpu_progress(progress: Progress, interval_s: float = 2.0,
                       cpu_seconds: Callable[[], float] = descendant_cpu_seconds):
    """While the block runs (e.g. a JIT compiler working in child processes), report the children's CPU seconds
    as the phase's progress whenever they grow: real work shows as progress, a hang does not."""
    stop = threading.Event()
    watch = ChildCpuWatch(progress, cpu_seconds)

    def run() -> None:
        while not stop.wait(interval_s):
            watch.poll()

    thread = threading.Thread(target=run, name="child-cpu-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
