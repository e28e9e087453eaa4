"""Block pool: reference counts, free list, and no leak after many requests finish or are aborted."""
from __future__ import annotations

import random

import pytest

from kestrel.cache.block_pool import BlockPool, OutOfBlocks


def test_allocate_release_round_trip():
    pool = BlockPool(8, 4)
    a = pool.allocate(3)
    assert pool.num_free == 5 and pool.num_used == 3
    pool.retain(a[:1])
    pool.release(a)
    assert pool.num_free == 7            # the retained block stays in use
    pool.release(a[:1])
    assert pool.num_free == 8
    pool.check_invariants()


def test_over_allocation_raises_and_changes_nothing():
    pool = BlockPool(4, 2)
    pool.allocate(3)
    with pytest.raises(OutOfBlocks):
        pool.allocate(2)
    assert pool.num_free == 1


def test_double_free_is_caught():
    pool = BlockPool(4, 2)
    a = pool.allocate(1)
    pool.release(a)
    with pytest.raises(AssertionError):
        pool.release(a)


def test_no_leak_after_1000_random_requests_finish_or_abort(checkpoint_factory):
    from kestrel.engine.engine import Engine
    from kestrel.config import EngineConfig
    from kestrel.sampling_params import SamplingParams

    engine = Engine(EngineConfig(model=str(checkpoint_factory("llama")), device="cpu", block_size=4,
                                 num_gpu_blocks_override=64, max_num_batched_tokens=64, max_num_seqs=32))
    rng = random.Random(0)
    live: list[str] = []
    vocab = engine.model_config.vocab_size
    for i in range(1000):
        rid = f"r{i}"
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 20))]
        engine.add_request(rid, prompt, SamplingParams(max_tokens=rng.randint(1, 6), temperature=1.0,
                                                       n=rng.choice([1, 1, 2]), ignore_eos=True))
        live.append(rid)
        if rng.random() < 0.3:
            engine.abort_request(live.pop(rng.randrange(len(live))))
        if i % 4 == 0:
            for update in engine.step():
                if update.finished and update.request_id in live and not engine.sequences(update.request_id):
                    live.remove(update.request_id)
            engine.pool.check_invariants()
    while engine.has_unfinished():
        engine.step()
    engine.prefix_cache.reset()
    assert engine.pool.num_free == engine.pool.num_blocks
    assert not engine.requests
    engine.pool.check_invariants()
