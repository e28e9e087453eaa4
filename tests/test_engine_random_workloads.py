"""Random workloads: whatever the batching, chunking, preemption and prefix sharing, every request's greedy tokens
equal what the same request gets alone in a roomy engine."""
from __future__ import annotations

import random

import pytest

from kestrel import LLM, SamplingParams


def workload(seed: int, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    shared = [[rng.randrange(3, vocab) for _ in range(rng.randint(5, 40))] for _ in range(3)]
    requests = []
    for _ in range(14):
        prefix = rng.choice(shared) if rng.random() < 0.6 else []
        own = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 30))]
        requests.append((prefix + own, rng.randint(1, 12)))
    return requests


@pytest.mark.parametrize("seed, block_size, num_blocks, budget, prefix_cache, graph_paths", [
    (0, 4, 40, 16, True, False), (1, 2, 70, 7, True, False), (2, 8, 14, 64, False, False),
    (3, 16, 9, 33, True, False), (4, 4, 40, 32, True, True), (5, 2, 60, 16, False, True),
])
def test_random_workload_matches_requests_run_alone(checkpoint_factory, seed, block_size, num_blocks, budget,
                                                     prefix_cache, graph_paths):
    path = str(checkpoint_factory("llama"))
    alone = LLM(model=path, device="cpu", disable_prefix_cache=True)
    requests = workload(seed, alone.engine.model_config.vocab_size)
    expected = [alone.generate([p], SamplingParams(max_tokens=m, temperature=0, ignore_eos=True))[0]
                .outputs[0].token_ids for p, m in requests]
    tight = LLM(model=path, device="cpu", block_size=block_size, num_gpu_blocks_override=num_blocks,
                max_num_batched_tokens=budget, max_num_seqs=6, disable_prefix_cache=not prefix_cache)
    if graph_paths:   # the CUDA-graph paths' bookkeeping, their bodies run eagerly on the CPU
        from kestrel.forward.decode_graphs import DecodeGraphs
        from kestrel.forward.prefill_graphs import PrefillGraphs
        runner = tight.engine.runner
        runner.graphs = DecodeGraphs(runner, max_bs=4, max_blocks_per_seq=64 // block_size * 2, max_rows=6)
        runner.prefill_graphs = PrefillGraphs(runner, max_blocks_per_seq=64 // block_size * 2, max_tokens=budget)
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for _, m in requests]
    got = tight.generate([p for p, _ in requests], params)
    assert [o.outputs[0].token_ids for o in got] == expected
    tight.engine.prefix_cache.reset()
    assert tight.engine.pool.num_free == tight.engine.pool.num_blocks
    tight.engine.pool.check_invariants()
