"""The server's two kinds of log line, as vLLM's: one per finished request, and a periodic throughput line.

    request cmpl-3f2a…: prompt 12 tokens, output 8 tokens, TTFT 15.2 ms, duration 85.3 ms, finish length
    prompt 240.1 tok/s, generation 95.3 tok/s, running 3 seqs, waiting 0 seqs, KV cache 4.2%, prefix cache hits 50.0%

The throughput line reads the engine's cumulative counters (EngineStats, refreshed after every engine step) and
logs the rates over the interval since the previous line; an idle interval logs nothing, so a quiet server has a
quiet log.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from kestrel.engine.messages import EngineStats

logger = logging.getLogger("kestrel.server")


def request_line(request_id: str, prompt_tokens: int, output_tokens: int, ttft_s: float | None, duration_s: float,
                 finish_reasons: list[str]) -> str:
    ttft = "-" if ttft_s is None else f"{1000 * ttft_s:.1f} ms"
    # one reason per choice; n choices that all stopped the same way read as one
    reasons = ",".join(dict.fromkeys(finish_reasons)) or "-"
    return (f"request {request_id}: prompt {prompt_tokens} tokens, output {output_tokens} tokens, TTFT {ttft}, "
            f"duration {1000 * duration_s:.1f} ms, finish {reasons}")


class StatsLogger:
    """Logs the throughput line every `interval_s` seconds while something happens."""

    def __init__(self, stats: Callable[[], EngineStats | None], interval_s: float) -> None:
        self.stats = stats
        self.interval_s = interval_s
        self._last: EngineStats | None = None
        self._last_time = time.monotonic()

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            line = self.tick(time.monotonic())
            if line is not None:
                logger.info("%s", line)

    def tick(self, now: float) -> str | None:
        """The line for the interval ending `now`, or None if nothing happened in it."""
        stats = self.stats()
        if stats is None:   # the engine is still starting
            return None
        last, elapsed = self._last, max(now - self._last_time, 1e-9)
        self._last, self._last_time = stats, now
        if last is None:    # the first snapshot is the baseline (warm-up tokens are not traffic)
            return None
        prompt = stats.prompt_tokens_total - last.prompt_tokens_total
        generated = stats.generation_tokens_total - last.generation_tokens_total
        busy = stats.num_running or stats.num_waiting
        # busy without new tokens still logs: a stuck queue is worth seeing
        if not (prompt or generated or busy):
            return None
        queries = stats.prefix_cache_queries - last.prefix_cache_queries
        hits = stats.prefix_cache_hits - last.prefix_cache_hits
        line = (f"prompt {prompt / elapsed:.1f} tok/s, generation {generated / elapsed:.1f} tok/s, "
                f"running {stats.num_running} seqs, waiting {stats.num_waiting} seqs, "
                f"KV cache {100 * stats.kv_cache_usage:.1f}%")
        if queries:
            line += f", prefix cache hits {100 * hits / queries:.1f}%"
        if stats.num_preemptions > last.num_preemptions:
            line += f", preempted {stats.num_preemptions - last.num_preemptions}"
        return line
