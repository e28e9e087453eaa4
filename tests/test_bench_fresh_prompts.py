"""kestrel/bench/fresh.py: the benches' fresh prompts share no cacheable prefix with one another (warm-up and timed
prompts drawn from one generator included), and the hit-rate fields say what the engine's counters say."""
from __future__ import annotations

import pytest

from kestrel.bench.fresh import CacheDelta, FreshPrompts, hit_rate_fields


def _block_prefixes(prompts: list[list[int]], block: int) -> list[tuple[int, ...]]:
    return [tuple(p[:block]) for p in prompts]


def test_warm_up_and_timed_prompts_have_distinct_heads_and_no_shared_block():
    fresh = FreshPrompts(4096, seed=0)
    warm = fresh.take(1, 128) + fresh.take(8, 128)     # engine_bench's two warm-ups, shapes as the timed runs
    timed = fresh.take(5, 128) + fresh.take(3, 128) + fresh.take(8, 128)
    everything = warm + timed
    assert all(len(p) == 128 for p in everything)
    assert all(2 <= t < 4096 for p in everything for t in p)
    heads = [p[0] for p in everything]
    assert len(set(heads)) == len(heads)
    # the prefix cache matches whole blocks from the start: no block-sized prefix (any block size) repeats
    for block in (1, 16, 64):
        assert len(set(_block_prefixes(everything, block))) == len(everything)
    assert fresh.remaining == 4094 - len(everything)


def test_a_seed_repeats_its_prompts_and_another_seed_does_not():
    assert FreshPrompts(1000, seed=3).take(4, 20) == FreshPrompts(1000, seed=3).take(4, 20)
    assert FreshPrompts(1000, seed=3).take(4, 20) != FreshPrompts(1000, seed=4).take(4, 20)


def test_heads_to_avoid_and_running_out():
    fresh = FreshPrompts(12, seed=0, low=2, avoid={2, 3})
    prompts = fresh.take(8, 5)   # ids 4..11: every head there is
    assert sorted(p[0] for p in prompts) == list(range(4, 12))
    with pytest.raises(ValueError, match="distinct first tokens"):
        fresh.one(5)   # a ninth would have to repeat a head: refused, not silently reused
    with pytest.raises(ValueError):
        FreshPrompts(2, low=2)


def test_hit_rate_fields():
    assert hit_rate_fields((100, 10), (300, 10)) == {"prefix_cache_hit_rate": 0.0, "prefix_cache_hit_tokens": 0,
                                                     "prefix_cache_query_tokens": 200}
    assert hit_rate_fields((0, 0), (200, 50))["prefix_cache_hit_rate"] == 0.25
    assert hit_rate_fields((5, 5), (5, 5))["prefix_cache_hit_rate"] is None   # nothing looked up: no rate


def test_cache_delta_reads_the_engine_counters_around_a_part():
    from kestrel.config import DEFAULT_MODEL_DIR
    from kestrel.llm import LLM
    from kestrel.sampling_params import SamplingParams

    llm = LLM(str(DEFAULT_MODEL_DIR), device="cpu")
    engine = llm.engine
    prompt = FreshPrompts(engine.runner.cfg.vocab_size).one(48)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    with CacheDelta(engine) as first:
        llm.generate([prompt], params)
    with CacheDelta(engine) as again:
        llm.generate([prompt], params)
    assert first.hit_rate == 0.0
    assert again.fields() == {"prefix_cache_hit_rate": 32 / 48, "prefix_cache_hit_tokens": 32,
                              "prefix_cache_query_tokens": 48}
    llm.shutdown()
