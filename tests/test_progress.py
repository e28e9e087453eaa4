"""Startup progress helpers: a JIT compiler's child processes show as progress, an idle wait does not.

No check here depends on wall-clock speed (a loaded machine runs a busy child slower, not differently): the phase
clock and the CPU-seconds reader are injected where timing matters, and the one check against real /proc readings
waits for a child that has itself burned a fixed amount of CPU time."""
from __future__ import annotations

import subprocess
import sys
import threading

from kestrel.progress import ChildCpuWatch, Progress, child_cpu_progress, descendant_cpu_seconds


class Recorder(Progress):
    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.updates: list[float] = []
        self.updated = threading.Event()

    def update(self, done: float) -> None:
        self.updates.append(done)
        super().update(done)
        self.updated.set()


class FakeClock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Scripted:
    """CPU-seconds readings in order; the last one repeats."""

    def __init__(self, *readings: float) -> None:
        self.readings = list(readings)

    def __call__(self) -> float:
        return self.readings.pop(0) if len(self.readings) > 1 else self.readings[0]


def test_growth_of_children_cpu_time_is_progress_and_a_standstill_is_not():
    progress = Recorder()
    progress.begin("compiling_kernels", unit="CPU s")
    watch = ChildCpuWatch(progress, Scripted(10.0, 10.05, 10.6, 10.65, 11.8, 11.8))   # first reading: the base
    for _ in range(5):
        watch.poll()
    assert [round(u, 6) for u in progress.updates] == [0.6, 1.8]   # growth under 0.1 s (start-up noise) is none
    idle = Recorder()
    idle.begin("compiling_kernels", unit="CPU s")
    watch = ChildCpuWatch(idle, Scripted(5.0, 5.02, 5.04, 5.04))
    for _ in range(3):
        watch.poll()
    assert idle.updates == []


def test_the_watcher_thread_reports_while_the_block_runs():
    progress = Recorder()
    progress.begin("compiling_kernels", unit="CPU s")
    with child_cpu_progress(progress, interval_s=0.01, cpu_seconds=Scripted(0.0, 0.0, 0.7)):
        assert progress.updated.wait(60), "no progress reported"   # an upper bound on a hang, not on speed
    assert [round(u, 6) for u in progress.updates] == [0.7]


def test_a_live_childs_cpu_time_is_visible_before_it_exits_and_a_sleeping_childs_is_not():
    # The busy child burns 0.6 s of its own CPU time (however long that takes on a loaded machine), says so, and
    # blocks on stdin; the idle child blocks at once. Both are alive while /proc is read.
    busy = ("import sys, time\nwhile time.process_time() < 0.6: pass\nprint('done', flush=True)\n"
            "sys.stdin.read()")
    idle = "import sys\nprint('done', flush=True)\nsys.stdin.read()"
    for code, check in ((busy, lambda cpu: cpu >= 0.5), (idle, lambda cpu: cpu < 0.5)):
        base = descendant_cpu_seconds()
        child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 text=True)
        try:
            assert child.stdout.readline().strip() == "done"
            cpu = descendant_cpu_seconds() - base
            assert check(cpu), f"children's CPU seconds {cpu:.2f}"
        finally:
            child.stdin.close()
            child.wait(timeout=60)


def test_progress_reads_its_clock_for_durations_rate_and_log_throttle(caplog):
    clock = FakeClock(100.0)
    progress = Progress(log_interval_s=1.0, clock=clock)
    clock.now = 102.0
    progress.begin("loading_weights", total=10.0, unit="")
    assert progress.phase_durations == {"starting": 2.0}
    with caplog.at_level("INFO", logger="kestrel.startup"):
        clock.now = 102.5
        progress.update(2.0)          # inside the log interval: recorded, not logged
        assert progress.done == 2.0 and progress.last_progress_time == 102.5 and not caplog.records
        clock.now = 104.0
        progress.update(4.0)          # 2 s into the phase, 4 of 10 done: 2/s, ETA 3 s
        assert [r.getMessage() for r in caplog.records] == ["loading weights 4/10, 2/s, ETA 3 s"]
    assert progress.fraction() == 0.4
    clock.now = 110.0
    assert progress.elapsed_s() == 10.0
    progress.ready()
    assert progress.phase_durations["loading_weights"] == 8.0 and progress.fraction() == 1.0
