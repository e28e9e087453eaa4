"""A run's progress line: finished requests out of the total, elapsed time, and an ETA only once some finished.

Why not tqdm's bar: it counts from the first update and smooths a rate over recent updates, so a peak run
(128 requests started at once, all finishing near the end) sits at 0/128 for a minute and then promises hours.
Here the ETA is remaining x elapsed / finished: the average rate at which requests actually finish.
"""
from __future__ import annotations

import sys
import time
from typing import TextIO


class RunProgress:
    """On a terminal, one line rewritten in place; elsewhere (a log, a pipe) a line every `log_interval_s`."""

    def __init__(self, name: str, total: int | None, duration_s: float | None = None, enabled: bool = True,
                 out: TextIO | None = None, log_interval_s: float = 10.0) -> None:
        self.name = name
        self.total = total                 # None: a --duration run, bounded by time instead
        self.duration_s = duration_s
        self.enabled = enabled
        self.out = out or sys.stderr
        self.tty = self.out.isatty()
        self.interval_s = 0.2 if self.tty else log_interval_s
        self.finished = 0
        self.failed = 0
        self.start = time.perf_counter()
        self._last_draw = self.start

    def update(self, success: bool) -> None:
        self.finished += 1
        self.failed += not success
        now = time.perf_counter()
        if self.enabled and now - self._last_draw >= self.interval_s:
            self._draw(now)

    def close(self) -> None:
        if self.enabled:
            self._draw(time.perf_counter(), final=True)

    def line(self, now: float | None = None) -> str:
        elapsed = (now or time.perf_counter()) - self.start
        done = f"{self.finished}/{self.total}" if self.total is not None else f"{self.finished}"
        parts = [f"[{self.name}] {done} finished"]
        if self.failed:
            parts.append(f"{self.failed} failed")
        parts.append(f"elapsed {_clock(elapsed)}")
        if self.total is not None and 0 < self.finished < self.total:
            parts.append(f"ETA {_clock(elapsed / self.finished * (self.total - self.finished))}")
        elif self.total is None and self.duration_s is not None:
            parts.append(f"{_clock(max(0.0, self.duration_s - elapsed))} left")
        return ", ".join(parts)

    def _draw(self, now: float, final: bool = False) -> None:
        self._last_draw = now
        if self.tty:
            self.out.write("\r\033[K" + self.line(now) + ("\n" if final else ""))
        else:
            self.out.write(self.line(now) + "\n")
        self.out.flush()


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    return f"{minutes}m{seconds:02d}s" if minutes < 60 else f"{minutes // 60}h{minutes % 60:02d}m"
