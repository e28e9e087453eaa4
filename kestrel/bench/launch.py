"""Start a server command, tee its log, wait for readiness, tell slow-but-progressing from stalled, stop it.

The server runs in its own session (process group), so stopping it reaches every worker it forked:
SIGTERM to the group, then SIGKILL to whatever is left after the grace period.
"""
from __future__ import annotations

import collections
import enum
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import httpx
import psutil

from kestrel.envs import child_environment
from kestrel.errors import KestrelError


class LaunchExit(enum.IntEnum):
    """`kestrel launch` exit codes (2 is a usage error, from the CLI)."""
    READY = 0           # became ready (and --then succeeded, or serving ended by Ctrl-C / SIGTERM)
    THEN_FAILED = 1     # ready, but the --then command exited non-zero
    CRASHED = 3         # the server exited on its own (before ready, or while --then ran)
    STALLED = 4         # no new log line and no /health progress for --stall-timeout seconds
    TIMED_OUT = 5       # still progressing, but not ready within --ready-timeout
    INTERRUPTED = 130   # Ctrl-C or SIGTERM before the server was ready


@dataclass(frozen=True, slots=True)
class LaunchConfig:
    command: tuple[str, ...]
    base_url: str
    log_file: str
    ready_timeout_s: float = 1800.0
    stall_timeout_s: float = 300.0
    then: str | None = None
    grace_s: float = 10.0
    poll_interval_s: float = 0.5
    status_interval_s: float = 10.0


def check_program(program: str) -> None:
    """The command's program exists and is executable: one error line now, not a traceback from Popen later."""
    if os.sep in program:
        if not (os.path.isfile(program) and os.access(program, os.X_OK)):
            raise KestrelError(f"server command {program!r} not found or not executable")
    elif shutil.which(program) is None:
        raise KestrelError(f"server command {program!r} not found on PATH (activate the environment it is "
                           "installed in, or give its full path)")


@dataclass(frozen=True, slots=True)
class Readiness:
    ready: bool
    phase: str | None = None          # Kestrel's /health body while starting
    progress: float | None = None
    elapsed_s: float | None = None


def probe_readiness(base_url: str, timeout_s: float = 2.0) -> Readiness:
    """Kestrel: /health is 503 {"phase","progress","elapsed_s"} until ready, then 200. Others: /health or
    /v1/models answering 200 once the port is open."""
    base = base_url.rstrip("/")
    try:
        with httpx.Client(timeout=timeout_s) as client:
            resp = client.get(base + "/health")
            if resp.status_code == 200:
                return Readiness(True, "ready", 1.0)
            if resp.status_code == 503:
                try:
                    body = resp.json()
                except ValueError:
                    body = {}
                body = body if isinstance(body, dict) else {}
                progress = body.get("progress")
                return Readiness(False, body.get("phase"), progress if isinstance(progress, (int, float)) else None,
                                 body.get("elapsed_s"))
            return Readiness(client.get(base + "/v1/models").status_code == 200)
    except httpx.HTTPError:
        return Readiness(False)


class ServerProcess:
    """The server command in its own process group, its output teed to `echo` and a log file."""

    def __init__(self, command: tuple[str, ...], log_file: str, echo: TextIO | None = None,
                 keep_lines: int = 50, env: dict[str, str] | None = None, append: bool = False) -> None:
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        self.log_file = log_file
        # append: a restarted replica continues its own log, so one file tells its whole story
        self._log = open(log_file, "a" if append else "w", encoding="utf-8", errors="replace")
        self._echo = echo
        self.last_lines: collections.deque[str] = collections.deque(maxlen=keep_lines)
        self.last_output_time = time.monotonic()
        self.num_lines = 0
        # PYTHONUNBUFFERED: log lines as they happen, not when a buffer fills; `env`: e.g. a replica's GPUs
        env = child_environment(PYTHONUNBUFFERED="1", **(env or {}))
        try:
            self.proc = subprocess.Popen(list(command), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True, env=env)
        except OSError:
            self._log.close()
            raise
        self._reader = threading.Thread(target=self._tee, daemon=True)
        self._reader.start()

    def _tee(self) -> None:
        for raw in iter(self.proc.stdout.readline, b""):
            line = raw.decode("utf-8", errors="replace")
            self.last_lines.append(line.rstrip("\n"))
            self.last_output_time = time.monotonic()
            self.num_lines += 1
            self._log.write(line)
            self._log.flush()
            if self._echo:
                self._echo.write(line)
                self._echo.flush()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def note(self, line: str) -> None:
        """A line of the launcher's own in this process's log (a death, a restart), beside the server's lines."""
        if not self._log.closed:
            self._log.write(line.rstrip("\n") + "\n")
            self._log.flush()

    def exited(self) -> int | None:
        return self.proc.poll()

    def processes(self) -> list[psutil.Process]:
        """The server, its descendants and anything else left in its process group, while alive."""
        found: dict[int, psutil.Process] = {}
        try:
            root = psutil.Process(self.pid)
            found = {p.pid: p for p in [root, *root.children(recursive=True)]}
        except psutil.NoSuchProcess:
            pass
        for p in psutil.process_iter():
            try:
                if p.pid not in found and os.getpgid(p.pid) == self.pid:
                    found[p.pid] = p
            except (OSError, psutil.Error):
                continue
        return _living(list(found.values()))

    def drain(self) -> None:
        """Wait (briefly) for the last output lines after the process exited."""
        self._reader.join(timeout=2)

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the group (and descendants that left it), SIGKILL what is left after grace_s."""
        procs = self.processes()
        self._signal_all(procs, signal.SIGTERM)
        if self._wait_gone(procs, grace_s):
            self._signal_all(_living(procs), signal.SIGKILL)
            self._wait_gone(procs, 5.0)
        self.proc.wait()
        self.drain()
        self._log.close()

    def _wait_gone(self, procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
        deadline = time.monotonic() + timeout_s
        while True:
            self.proc.poll()   # reap our own child so it does not linger as a zombie
            left = _living(procs)
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.05)

    def _signal_all(self, procs: list[psutil.Process], sig: signal.Signals) -> None:
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        for p in procs:   # descendants that called setsid() are outside the group
            try:
                p.send_signal(sig)
            except psutil.Error:
                pass


def _living(procs: list[psutil.Process]) -> list[psutil.Process]:
    """Processes still running (zombies are dead: only their parent's wait is missing)."""
    alive = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except psutil.Error:
            continue
    return alive


def diagnose(server: ServerProcess, out: TextIO, last_lines: int = 30) -> None:
    """What a stalled server is doing: process tree with CPU time, GPU use, last log lines, py-spy stacks."""
    print("---- process tree (pid, status, cpu user/sys s, rss MB, command) ----", file=out)
    for p in server.processes():
        try:
            with p.oneshot():
                cpu = p.cpu_times()
                print(f"{p.pid:>8} {p.status():<10} {cpu.user:8.1f} {cpu.system:8.1f} "
                      f"{p.memory_info().rss / 2**20:8.0f}  {' '.join(p.cmdline())[:160]}", file=out)
        except psutil.Error:
            continue
    if shutil.which("nvidia-smi"):
        print("---- GPUs (index, utilization, memory used, memory total) ----", file=out)
        print(_run(["nvidia-smi", "--query-gpu=index,utilization.gpu,memory.used,memory.total",
                    "--format=csv,noheader"]), file=out)
    print(f"---- last {last_lines} log lines ({server.log_file}) ----", file=out)
    for line in list(server.last_lines)[-last_lines:]:
        print(line, file=out)
    if shutil.which("py-spy"):
        for p in server.processes():
            try:
                is_python = "python" in p.name().lower()
            except psutil.Error:
                continue
            if is_python:
                print(f"---- py-spy dump --pid {p.pid} ----", file=out)
                print(_run(["py-spy", "dump", "--pid", str(p.pid)]), file=out)
    out.flush()


def _run(cmd: list[str]) -> str:
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        return (res.stdout + res.stderr).strip()
    except (OSError, subprocess.SubprocessError) as exc:
        return f"({' '.join(cmd[:2])} failed: {exc})"


def _describe(state: Readiness, waited_s: float, idle_s: float) -> str:
    parts = [f"waited {waited_s:.0f} s"]
    if state.phase:
        parts.append(f"phase {state.phase}")
    if state.progress is not None:
        parts.append(f"{100 * state.progress:.0f}%")
    if state.elapsed_s is not None:
        parts.append(f"server elapsed {float(state.elapsed_s):.0f} s")
    parts.append(f"last activity {idle_s:.1f} s ago")
    return ", ".join(parts)


def wait_until_ready(server: ServerProcess, cfg: LaunchConfig, out: TextIO) -> LaunchExit:
    """Poll until ready. Activity = a new log line or a change of (phase, progress) on /health."""
    start = last_activity = last_status = time.monotonic()
    last_key: tuple[Any, Any] | None = None
    while True:
        if server.exited() is not None:
            server.drain()   # let the last lines land before reporting
            print(f"[launch] server exited with code {server.exited()} before it was ready", file=out)
            return LaunchExit.CRASHED
        state = probe_readiness(cfg.base_url)
        now = time.monotonic()
        if state.ready:
            print(f"[launch] ready at {cfg.base_url} after {now - start:.1f} s", file=out)
            return LaunchExit.READY
        if state.phase is not None and (state.phase, state.progress) != last_key:
            last_key, last_activity = (state.phase, state.progress), now
        last_activity = max(last_activity, server.last_output_time)
        waited, idle = now - start, now - last_activity
        if idle > cfg.stall_timeout_s:
            print(f"[launch] STALLED: no log line and no progress for {idle:.0f} s "
                  f"(--stall-timeout {cfg.stall_timeout_s:g}); {_describe(state, waited, idle)}", file=out)
            diagnose(server, out)
            return LaunchExit.STALLED
        if waited > cfg.ready_timeout_s:
            print(f"[launch] TIMED OUT: not ready after {waited:.0f} s (--ready-timeout "
                  f"{cfg.ready_timeout_s:g}) though still progressing; {_describe(state, waited, idle)}", file=out)
            diagnose(server, out)
            return LaunchExit.TIMED_OUT
        if now - last_status >= cfg.status_interval_s:
            print(f"[launch] starting, slow but progressing: {_describe(state, waited, idle)}", file=out)
            out.flush()
            last_status = now
        time.sleep(cfg.poll_interval_s)


def run_then(command: str, base_url: str, server: ServerProcess, out: TextIO) -> LaunchExit:
    """Run --then with {base_url} and $KESTREL_BASE_URL; a server crash meanwhile ends it."""
    command = command.replace("{base_url}", base_url)
    print(f"[launch] running: {command}", file=out)
    out.flush()
    then = subprocess.Popen(command, shell=True, env=child_environment(KESTREL_BASE_URL=base_url),
                            start_new_session=True)
    try:
        while then.poll() is None:
            if server.exited() is not None:
                print(f"[launch] server exited with code {server.exited()} while --then ran", file=out)
                return LaunchExit.CRASHED
            time.sleep(0.2)
    finally:
        if then.poll() is None:
            os.killpg(then.pid, signal.SIGTERM)
            then.wait()
    print(f"[launch] --then exited with code {then.returncode}", file=out)
    return LaunchExit.READY if then.returncode == 0 else LaunchExit.THEN_FAILED


class _Terminated(Exception):
    pass


def _raise_terminated(signum, frame) -> None:
    raise _Terminated()


def launch(cfg: LaunchConfig, out: TextIO | None = None, echo: TextIO | None = None) -> LaunchExit:
    """Start, wait, optionally run --then (else serve until Ctrl-C / SIGTERM), and always stop the server.

    Status goes to `out` (default stderr), the server's own output to `echo` (default stdout) and the log file.
    """
    out, echo = out or sys.stderr, echo or sys.stdout
    print(f"[launch] starting: {' '.join(cfg.command)} (log: {cfg.log_file})", file=out)
    server = ServerProcess(cfg.command, cfg.log_file, echo)
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_terminated) if in_main else None
    try:
        outcome = wait_until_ready(server, cfg, out)
        if outcome is not LaunchExit.READY:
            return outcome
        if cfg.then:
            return run_then(cfg.then, cfg.base_url, server, out)
        code = server.proc.wait()   # serve in the foreground until it exits or we are told to stop
        print(f"[launch] server exited with code {code}", file=out)
        return LaunchExit.READY if code == 0 else LaunchExit.CRASHED
    except (KeyboardInterrupt, _Terminated):
        print("[launch] interrupted: stopping the server", file=out)
        return LaunchExit.READY if probe_readiness(cfg.base_url).ready else LaunchExit.INTERRUPTED
    finally:
        server.stop(cfg.grace_s)
        print(f"[launch] server stopped (log: {cfg.log_file})", file=out)
        if in_main:
            signal.signal(signal.SIGTERM, previous)
