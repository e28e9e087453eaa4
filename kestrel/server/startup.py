"""Server startup: the engine's phases as /health sees them, and a watchdog that tells slow from stuck.

The engine reports phases through `Progress` (kestrel/progress.py), which already logs "loading weights
7.20/16.10 GB, 2.30 GB/s, ETA 4 s". This subclass adds what a server needs on top: a JSON status for /health, a
terminal `failed` phase, and a watchdog thread that, when a phase makes no progress for `stall_timeout` seconds,
reports the phase as `stalled` and dumps every thread's Python stack into the log so the hang can be located
(the server's threads, and the engine process's, which it asks for through `engine_stacks`).
"""
from __future__ import annotations

import faulthandler
import logging
import sys
import threading
import time
from typing import Callable

from kestrel.progress import Progress, format_all_stacks  # noqa: F401 - re-exported

logger = logging.getLogger("kestrel.startup")

TERMINAL_PHASES = ("ready", "failed")


class StartupProgress(Progress):
    def __init__(self, stall_timeout_s: float | None = 300.0, log_interval_s: float = 1.0) -> None:
        super().__init__(log_interval_s=log_interval_s)
        self.stall_timeout_s = stall_timeout_s
        self.stalled = False          # set by the watchdog, cleared by the next progress report
        self.error: str | None = None
        self._stop = threading.Event()
        self._watchdog: threading.Thread | None = None
        self._engine_stacks: Callable[[], str] | None = None

    # -- progress reports (any thread) --------------------------------------------------------------------------

    def begin(self, phase: str, total: float | None = None, unit: str = "") -> None:
        self.stalled = False
        super().begin(phase, total, unit)
        self._arm_faulthandler()

    def update(self, done: float) -> None:
        if self.stalled:
            logger.info("phase %s is making progress again", self.phase)
        self.stalled = False
        super().update(done)
        self._arm_faulthandler()

    def fail(self, message: str) -> None:
        """The terminal phase; /health carries the message. Not logged here: whoever runs the server says it once
        (`kestrel serve` as its last line, an embedder through KestrelServer.startup_error)."""
        self.error = message
        self.begin("failed")

    @property
    def is_ready(self) -> bool:
        return self.phase == "ready"

    def status(self) -> dict:
        """The /health body: {"phase", "progress", "elapsed_s", "phases"} (+ "error" once failed)."""
        body = {
            "phase": "stalled" if self.stalled else self.phase,
            "progress": self.fraction(),
            "elapsed_s": round(self.elapsed_s(), 3),
            # seconds spent in each finished phase, for cold-start reports (benchmarks/cold_start.py)
            "phases": {name: round(seconds, 3) for name, seconds in self.phase_durations.items()},
        }
        if self.stalled:
            body["stalled_phase"] = self.phase
        if self.error:
            body["error"] = self.error
        return body

    # -- watchdog -----------------------------------------------------------------------------------------------

    def start_watchdog(self, engine_stacks: Callable[[], str] | None = None) -> None:
        """`engine_stacks`: the engine process's stacks, logged with this process's when a phase stalls."""
        if not self.stall_timeout_s or self._watchdog is not None:
            return
        self._engine_stacks = engine_stacks
        self._watchdog = threading.Thread(target=self._watch, name="kestrel-stall-watchdog", daemon=True)
        self._watchdog.start()
        self._arm_faulthandler()

    def _arm_faulthandler(self) -> None:
        """Backstop for hangs that hold the GIL (a C extension blocked in a read, a driver call), where the Python
        watchdog cannot run: faulthandler's C thread dumps every stack to stderr after twice the timeout (the Python
        watchdog, which also updates /health, gets the first chance). It is
        process-wide, so it is re-armed on every progress report and cancelled once startup is over."""
        if self._watchdog is None:
            return
        if self.phase in TERMINAL_PHASES or self._stop.is_set():
            faulthandler.cancel_dump_traceback_later()
            return
        try:
            faulthandler.dump_traceback_later(self.stall_timeout_s * 2, exit=False, file=sys.__stderr__)
        except (ValueError, AttributeError, OSError):   # no usable stderr (embedded, closed)
            pass

    def stop_watchdog(self) -> None:
        self._stop.set()
        faulthandler.cancel_dump_traceback_later()
        if self._watchdog is not None:
            self._watchdog.join(timeout=2.0)

    def _watch(self) -> None:
        interval = min(1.0, self.stall_timeout_s / 4)
        while not self._stop.wait(interval):
            if self.phase in TERMINAL_PHASES:
                return
            quiet_s = time.monotonic() - self.last_progress_time
            if quiet_s >= self.stall_timeout_s and not self.stalled:
                # Stacks go to the log before /health says "stalled", so whoever sees the flag finds them.
                stacks = format_all_stacks()
                if self._engine_stacks is not None:
                    stacks += "\n" + self._engine_stacks()
                logger.error("phase %s made no progress for %.0f s (--stall-timeout %g); thread stacks:\n%s",
                             self.phase, quiet_s, self.stall_timeout_s, stacks)
                self.stalled = True

