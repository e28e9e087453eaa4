"""Where a decode loop's host time goes: the intervals between engine.step() returns, and the garbage
collector's pauses inside them.

With the overlap schedule the host runs one step ahead of the GPU, so a host stall shorter than a GPU step costs
nothing and a longer one leaves the GPU idle. The bs1 bench's decode tokens took ~1.2% longer than the profile's
steps (BENCHMARKS.md, session 14); this tells a uniform slowdown from a few long stalls, and counts the stalls
that are the collector's.
"""
from __future__ import annotations

import gc
import statistics
import time


class GcPauses:
    """Context manager: every collection that runs inside it, as (generation, seconds)."""

    def __init__(self) -> None:
        self.pauses: list[tuple[int, float]] = []
        self._start = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.pauses.append((info["generation"], time.perf_counter() - self._start))

    def __enter__(self) -> "GcPauses":
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)

    def summary(self) -> dict:
        by_gen: dict[str, list[float]] = {}
        for gen, seconds in self.pauses:
            by_gen.setdefault(str(gen), []).append(seconds)
        return {gen: {"count": len(s), "total_ms": round(1000 * sum(s), 3), "max_ms": round(1000 * max(s), 3)}
                for gen, s in sorted(by_gen.items())}


def interval_summary(intervals_s: list[float]) -> dict:
    """Median, tail and the time spent above 1.5x the median (the long stalls), in ms."""
    if not intervals_s:
        return {}
    ms = sorted(1000 * s for s in intervals_s)
    median = statistics.median(ms)
    slow = [m for m in ms if m > 1.5 * median]
    return {"count": len(ms), "median_ms": round(median, 4), "mean_ms": round(sum(ms) / len(ms), 4),
            "p99_ms": round(ms[min(len(ms) - 1, int(0.99 * len(ms)))], 4), "max_ms": round(ms[-1], 4),
            "slow_count": len(slow), "slow_excess_ms": round(sum(m - median for m in slow), 3)}
