"""Startup progress helpers: a JIT compiler's child processes show as progress, an idle wait does not."""
from __future__ import annotations

import subprocess
import sys
import time

from kestrel.progress import Progress, child_cpu_progress, descendant_cpu_seconds


class Recorder(Progress):
    def __init__(self) -> None:
        super().__init__()
        self.updates: list[float] = []

    def update(self, done: float) -> None:
        self.updates.append(done)
        super().update(done)


def test_busy_children_report_progress_and_sleeping_ones_do_not():
    progress = Recorder()
    progress.begin("compiling_kernels", unit="CPU s")
    busy = "import time\nt = time.time()\nwhile time.time() - t < 1.5: pass"
    with child_cpu_progress(progress, interval_s=0.3):
        child = subprocess.Popen([sys.executable, "-c", busy])
        time.sleep(1.0)
        assert descendant_cpu_seconds() > 0.3   # a live child's CPU time is visible before it exits
        child.wait()
    assert progress.updates and progress.updates[-1] >= 0.5
    idle = Recorder()
    idle.begin("compiling_kernels", unit="CPU s")
    with child_cpu_progress(idle, interval_s=0.3):
        subprocess.run([sys.executable, "-c", "import time; time.sleep(1.2)"], check=True)
    assert max(idle.updates, default=0.0) < 0.5   # interpreter start-up at most: a sleeping child is no progress
