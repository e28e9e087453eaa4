"""This node's worker processes (ranks > 0), started and watched.

A worker is `python -m kestrel.ranks.worker`, its WorkerSpec pickled on its stdin. stdin stays open: the
worker exits when it reaches EOF, so workers never outlive the process that started them (a killed server, a
crashed engine process, a test that forgot to shut down).

    RankWatch (a thread of the process that started the workers; rank 0's process or a node's `kestrel serve`)
      every 0.2 s: a local worker that exited          -> "tensor-parallel rank R (pid P) exited with code C"
                   `failed` in the store (another node) -> that node's message            (rank 0 only)
                   a step running past the timeout      -> "a step has waited N s on the ranks" (rank 0 only)
      the first of these goes to on_failure, once
"""
from __future__ import annotations

import logging
import pickle
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable

from kestrel.config import EngineConfig
from kestrel.ranks.group import FAILED_KEY, Rendezvous
from kestrel.envs import child_environment

logger = logging.getLogger("kestrel.distributed")

POLL_S = 0.2


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """Everything a worker process needs, pickled onto its stdin."""
    config: EngineConfig
    rendezvous: Rendezvous
    rank: int
    log_level: int


def start_workers(config: EngineConfig, rdv: Rendezvous, ranks: range) -> dict[int, subprocess.Popen]:
    procs = {}
    for rank in ranks:
        proc = subprocess.Popen([sys.executable, "-m", "kestrel.ranks.worker"], stdin=subprocess.PIPE,
                                env=child_environment(NCCL_NVLS_ENABLE="0"))
        spec = WorkerSpec(config, rdv, rank, logging.getLogger("kestrel").getEffectiveLevel())
        proc.stdin.write(pickle.dumps(spec))
        proc.stdin.flush()   # and left open: EOF tells the worker to exit
        procs[rank] = proc
        logger.info("started tensor-parallel rank %d (pid %d)", rank, proc.pid)
    return procs


def stop_workers(procs: dict[int, subprocess.Popen], timeout_s: float = 10.0) -> None:
    """Close their stdin (they exit on EOF), wait, then kill what is left."""
    for proc in procs.values():
        try:
            proc.stdin.close()
        except OSError:
            pass
    deadline = time.monotonic() + timeout_s
    for rank, proc in procs.items():
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning("tensor-parallel rank %d (pid %d) did not exit; killing it", rank, proc.pid)
            proc.kill()
            proc.wait()


class RankWatch:
    """Watches the ranks from a thread and calls on_failure(message) once, for the first rank found dead or hung.

    busy_since() is when the step now running began (None: idle); store: rank 0's store, read for other nodes'
    failures (None on the other nodes, which write to it instead: ranks/node.py)."""

    def __init__(self, procs: dict[int, subprocess.Popen], on_failure: Callable[[str], None], store=None,
                 busy_since: Callable[[], float | None] = lambda: None, step_timeout_s: float = 300.0,
                 clean_exit_ok: bool = False) -> None:
        self.procs = procs
        self.clean_exit_ok = clean_exit_ok   # a node's watch: exit code 0 is a worker that rank 0 stopped
        self.on_failure = on_failure
        self.store = store
        self.busy_since = busy_since
        self.step_timeout_s = step_timeout_s
        self.failure: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kestrel-rank-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """No more reports: the workers are being stopped on purpose."""
        self._stop.set()
        self._thread.join(2 * POLL_S + 1.0)

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            message = self._check()
            if message is not None and not self._stop.is_set():
                self.failure = message
                logger.error("%s", message)
                self.on_failure(message)
                return

    def _check(self) -> str | None:
        for rank, proc in self.procs.items():
            code = proc.poll()
            if code is not None and not (code == 0 and self.clean_exit_ok):
                return f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {code}"
        if self.store is not None and self.store.check([FAILED_KEY]):
            return self.store.get(FAILED_KEY).decode()
        started = self.busy_since()
        if started is not None and time.monotonic() - started > self.step_timeout_s:
            return (f"a step has waited {time.monotonic() - started:.0f} s on the tensor-parallel ranks (more than "
                    "--dist-timeout): a rank hangs")
        return None
