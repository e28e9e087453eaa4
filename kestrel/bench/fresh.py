"""Fresh prompts and the prefix-cache hit rate of a timed part, for the in-process benchmarks (benchmarks/*.py).

A prompt sent twice is a prefix-cache hit the second time: its TTFT is a cache lookup's, its throughput skips most
of the prefill. `FreshPrompts` draws random token-id prompts no two of which start with the same token, across every
call on one instance (warm-up and timed parts draw from the same one), so no prompt shares a cached block with any
other it drew. `CacheDelta` reads the engine's prefix-cache counters (Engine.stats()) before and after a timed part
and says what share of that part's prompt tokens came from the cache: the figure written beside every timing, as
`kestrel bench serve` reports it from /metrics.
"""
from __future__ import annotations

import random
from collections.abc import Iterable
from typing import Any


class FreshPrompts:
    """Random prompts of token ids in [low, vocab_size) with pairwise distinct first tokens.

    The prefix cache matches whole blocks from a prompt's start: two prompts whose first tokens differ share no
    block, whatever the block size. The heads are a seeded shuffle of the vocabulary, handed out once each."""

    def __init__(self, vocab_size: int, seed: int = 0, low: int = 2, avoid: Iterable[int] = ()) -> None:
        """avoid: first tokens not to use (those of prompts made elsewhere, e.g. a chat template's)."""
        if vocab_size - low < 1:
            raise ValueError(f"no token ids in [{low}, {vocab_size})")
        self.vocab_size, self.low = vocab_size, low
        self._rng = random.Random(seed)
        avoid = set(avoid)
        self._heads = [t for t in range(low, vocab_size) if t not in avoid]
        self._rng.shuffle(self._heads)

    @property
    def remaining(self) -> int:
        """Prompts this instance can still draw."""
        return len(self._heads)

    def take(self, n: int, length: int) -> list[list[int]]:
        """n new prompts of `length` tokens each."""
        if length < 1:
            raise ValueError(f"prompt length {length} is invalid: expected >= 1")
        if n > len(self._heads):
            raise ValueError(f"{n} fresh prompts asked, {len(self._heads)} distinct first tokens left "
                             f"(vocabulary {self.vocab_size})")
        rng = self._rng
        return [[self._heads.pop()] + [rng.randrange(self.low, self.vocab_size) for _ in range(length - 1)]
                for _ in range(n)]

    def one(self, length: int) -> list[int]:
        return self.take(1, length)[0]


def cache_counters(engine) -> tuple[int, int]:
    """(prompt tokens looked up in the prefix cache, of those served from it) so far: Engine.stats()'s counters.
    Called outside the timed part (stats() walks the cache's tree)."""
    stats = engine.stats()
    return stats.prefix_cache_queries, stats.prefix_cache_hits


def hit_rate_fields(before: tuple[int, int], after: tuple[int, int]) -> dict[str, Any]:
    """The JSON fields for the part between two cache_counters() readings: prefix_cache_hit_rate (hit tokens /
    looked-up prompt tokens; None when nothing was looked up) and the two token counts."""
    queries, hits = after[0] - before[0], after[1] - before[1]
    return {"prefix_cache_hit_rate": hits / queries if queries > 0 else None,
            "prefix_cache_hit_tokens": hits, "prefix_cache_query_tokens": queries}


class CacheDelta:
    """`with CacheDelta(engine) as d: <timed part>`; then d.fields() (see hit_rate_fields)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.before: tuple[int, int] | None = None
        self.after: tuple[int, int] | None = None

    def __enter__(self) -> CacheDelta:
        self.before = cache_counters(self.engine)
        return self

    def __exit__(self, *exc) -> None:
        self.after = cache_counters(self.engine)

    def fields(self) -> dict[str, Any]:
        assert self.before is not None and self.after is not None, "fields() before the timed part ended"
        return hit_rate_fields(self.before, self.after)

    @property
    def hit_rate(self) -> float | None:
        return self.fields()["prefix_cache_hit_rate"]
