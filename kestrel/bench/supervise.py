"""Keep a started ReplicaSet serving: a replica (or the router) that dies is restarted with exponential backoff,
the others keep serving meanwhile; the launch gives up only when every replica (or the router) keeps dying.

    death ──► log it (code or signal, deaths in the window) ──► wait backoff ──► start again (same port, same log)
                                                                                  │
                                    /health 200 ◄── poll, ready timeout counts as a death

smg routes around a dead worker at once (a refused connection is retried on another worker), but the failures open
that worker's circuit breaker, and with its default 60 s health checks it would not notice the worker return for
a minute or more. So a replica that is back is registered with the router afresh (`on_back`: smg's worker API,
DELETE then POST /workers), which routes to it at once.

Backoff: the n-th death within `window_s` waits backoff_s x 2^(n-1), capped at backoff_max_s; deaths older than the
window are forgotten, so a replica that served for a while restarts after backoff_s again.
"""
from __future__ import annotations

import collections
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TextIO

from kestrel.bench.launch import LaunchExit, ServerProcess, probe_readiness


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    backoff_s: float = 1.0        # the delay before the first restart; doubles with each death in the window
    backoff_max_s: float = 30.0
    max_restarts: int = 5         # more deaths than this within window_s: the process is crash-looping
    window_s: float = 300.0

    def delay(self, deaths_in_window: int) -> float:
        return min(self.backoff_max_s, self.backoff_s * 2 ** max(0, deaths_in_window - 1))


def describe_exit(code: int | None) -> str:
    """'exit code 3' or 'killed by SIGKILL' (Popen's returncode is -N for signal N)."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


@dataclass(slots=True)
class Member:
    """One supervised process: a replica or the router."""
    name: str                                   # "replica 1", "the router"
    url: str                                    # whose /health says it is back
    start: Callable[[], ServerProcess]          # starts it again (its log appended)
    get: Callable[[], ServerProcess]            # the current process
    is_replica: bool = True
    on_back: Callable[[], str | None] | None = None   # once it is back: tell the router; returns an error or None
    deaths: collections.deque = field(default_factory=collections.deque)   # monotonic times
    restarts: int = 0
    restart_at: float | None = None             # a restart is due at this time
    starting_since: float | None = None         # restarted, waiting for /health
    up_since: float = 0.0

    def crash_looping(self, policy: RestartPolicy, now: float) -> bool:
        while self.deaths and now - self.deaths[0] > policy.window_s:
            self.deaths.popleft()
        return len(self.deaths) > policy.max_restarts


class Supervisor:
    """`tick()` every fraction of a second: notices deaths, restarts when due, sees restarted members back.
    Returns a LaunchExit only when the launch should end (every replica crash-looping, or the router)."""

    def __init__(self, members: list[Member], policy: RestartPolicy, out: TextIO, ready_timeout_s: float,
                 grace_s: float, clock: Callable[[], float] = time.monotonic,
                 ready: Callable[[str], bool] = lambda url: probe_readiness(url).ready) -> None:
        self.members = members
        self.policy = policy
        self.out = out
        self.ready_timeout_s = ready_timeout_s
        self.grace_s = grace_s
        self.clock = clock
        self.ready = ready
        now = clock()
        for m in members:
            m.up_since = now

    def _say(self, member: Member, text: str) -> None:
        line = f"[launch] {member.name}: {text}"
        print(line, file=self.out)
        self.out.flush()
        member.get().note(line)

    def tick(self) -> LaunchExit | None:
        for m in self.members:
            self._check(m, self.clock())
        now = self.clock()
        replicas = [m for m in self.members if m.is_replica]
        if replicas and all(m.crash_looping(self.policy, now) for m in replicas):
            print(f"[launch] giving up: every replica died more than {self.policy.max_restarts} time(s) within "
                  f"{self.policy.window_s:g} s (--max-restarts, --restart-window)", file=self.out)
            return LaunchExit.CRASHED
        for m in self.members:
            if not m.is_replica and m.crash_looping(self.policy, now):
                print(f"[launch] giving up: {m.name} died more than {self.policy.max_restarts} time(s) within "
                      f"{self.policy.window_s:g} s (--max-restarts, --restart-window)", file=self.out)
                return LaunchExit.CRASHED
        return None

    def _check(self, m: Member, now: float) -> None:
        proc = m.get()
        if m.restart_at is None and (code := proc.exited()) is not None:
            self._died(m, now, f"died ({describe_exit(code)})")
        elif m.restart_at is None and m.starting_since is not None:
            if self.ready(m.url):
                m.starting_since, m.up_since = None, now
                self._say(m, f"back at {m.url} (restart {m.restarts}, ready after "
                             f"{now - (m.deaths[-1] if m.deaths else now):.1f} s since it died)")
                if m.on_back is not None:
                    error = m.on_back()
                    self._say(m, f"could not register it with the router again: {error}" if error else
                              "registered with the router again")
            elif now - m.starting_since > self.ready_timeout_s:
                self._died(m, now, f"not ready {now - m.starting_since:.0f} s after its restart (--ready-timeout)")
        if m.restart_at is not None and now >= m.restart_at:
            m.restart_at, m.restarts = None, m.restarts + 1
            try:
                m.start()
            except OSError as exc:   # e.g. its executable is gone: a death like any other
                m.deaths.append(now)
                m.restart_at = now + self.policy.delay(len(m.deaths))
                print(f"[launch] {m.name}: restart {m.restarts} failed: {exc}", file=self.out)
                return
            m.starting_since = now
            self._say(m, f"restart {m.restarts} (pid {m.get().pid}, log: {m.get().log_file})")

    def _died(self, m: Member, now: float, why: str) -> None:
        m.get().drain()   # its last lines into its log before the launcher's line
        m.deaths.append(now)
        m.crash_looping(self.policy, now)   # forget deaths older than the window
        delay = self.policy.delay(len(m.deaths))
        was_up = "" if m.starting_since is not None else f" after {now - m.up_since:.0f} s up"
        m.starting_since = None
        m.restart_at = now + delay
        self._say(m, f"{why}{was_up}; {len(m.deaths)} death(s) in the last {self.policy.window_s:g} s; "
                     f"restart {m.restarts + 1} in {delay:g} s")
        m.get().stop(self.grace_s)   # the rest of its process group (an engine process the server forked)
