"""A run's progress line, honest from the first second: requests sent, in flight and finished, tokens streamed, and
an ETA only where the run's own pace supports one.

Why not tqdm's bar, nor an ETA from finished requests alone: a peak run (128 requests sent at once, all finishing
near the end) sits at 0/128 for a minute, and the first request to finish, a second before the others, would
promise remaining x elapsed / finished = hours. So the ETA comes from what moves steadily:

- streamed runs: tokens. Expected tokens (each request's max_tokens) minus those streamed so far, over the rate
  since the first token arrived (prefill excluded). With --ignore-eos that count is exact; without, an upper bound.
- non-streamed runs: finished requests, but only while requests still wait to be sent (the cap or the arrival rate
  paces the run, so finishing is steady); once all are in flight, when they finish says nothing about the rest.
"""
from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

MIN_TOKEN_RATE_S = 1.0   # seconds of streamed tokens before their rate makes an ETA


class RunProgress:
    """On a terminal, one line rewritten in place; elsewhere (a log, a pipe) a line every `log_interval_s`, the
    first after a second. `tick()` draws when due (run_load calls it on a timer, so the line moves before any
    request finishes). `clock`: seconds, monotonic; tests pass a fake one."""

    def __init__(self, name: str, total: int | None, duration_s: float | None = None, enabled: bool = True,
                 out: TextIO | None = None, log_interval_s: float = 10.0, expected_tokens: int | None = None,
                 streamed: bool = False, clock: Callable[[], float] = time.perf_counter) -> None:
        self.name = name
        self.total = total                 # None: a --duration run, bounded by time instead
        self.duration_s = duration_s
        self.enabled = enabled
        self.out = out or sys.stderr
        self.tty = self.out.isatty()
        self.interval_s = 0.2 if self.tty else log_interval_s
        self.expected_tokens = expected_tokens   # the sum of max_tokens (None: unknown, e.g. a duration run)
        self.streamed = streamed
        self.clock = clock
        self.sent = 0
        self.finished = 0
        self.failed = 0
        self.tokens = 0                    # streamed so far (live), or output tokens of finished requests
        self.first_token_at: float | None = None
        self.start = clock()
        self._last_draw = self.start - self.interval_s + min(1.0, self.interval_s)   # first line after 1 s

    def request_sent(self) -> None:
        self.sent += 1

    def add_tokens(self, n: int) -> None:
        if n > 0 and self.first_token_at is None:
            self.first_token_at = self.clock()
        self.tokens += n

    def update(self, success: bool, tokens: int = 0) -> None:
        """A request finished; `tokens`: output tokens not yet counted through add_tokens (a correction)."""
        self.finished += 1
        self.failed += not success
        self.tokens += tokens
        self.tick()

    def tick(self) -> None:
        now = self.clock()
        if self.enabled and now - self._last_draw >= self.interval_s:
            self._draw(now)

    def close(self) -> None:
        if self.enabled:
            self._draw(self.clock(), final=True)

    def eta_s(self, now: float) -> float | None:
        if self.total is None or self.finished >= self.total:
            return None
        if self.streamed:
            if self.expected_tokens is None or self.first_token_at is None:
                return None
            streaming_s = now - self.first_token_at
            if streaming_s < MIN_TOKEN_RATE_S or self.tokens <= 0:
                return None
            return max(0, self.expected_tokens - self.tokens) / (self.tokens / streaming_s)
        if self.finished == 0 or self.sent >= self.total:
            return None
        return (now - self.start) / self.finished * (self.total - self.finished)

    def line(self, now: float | None = None) -> str:
        now = self.clock() if now is None else now
        elapsed = now - self.start
        of_total = f"/{self.total}" if self.total is not None else ""
        parts = [f"[{self.name}] {self.finished}{of_total} finished"]
        if self.failed:
            parts.append(f"{self.failed} failed")
        in_flight = self.sent - self.finished
        if self.sent and (in_flight or (self.total is not None and self.sent < self.total)):
            parts.append(f"{in_flight} in flight, {self.sent}{of_total} sent")
        if self.tokens or self.streamed:
            of_expected = f"/{self.expected_tokens}" if self.expected_tokens is not None else ""
            parts.append(f"{self.tokens}{of_expected} tokens")
        parts.append(f"elapsed {_clock(elapsed)}")
        if (eta := self.eta_s(now)) is not None:
            parts.append(f"ETA {_clock(eta)}")
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
