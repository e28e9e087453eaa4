"""Speculative decoding with tensor parallelism on the CPU (gloo, float32), on the default model and its shipped
EAGLE-3 drafter (trained, so drafts are accepted; it shares the target's embedding, so rank 0 gathers the whole
table at startup). Rank 0 drafts (the drafter lives there alone) and verifies; the drafts reach rank 1 inside the
verify step's chunks, and a tree step's accepted K/V moves on both ranks (docs/speculative.md).

Greedy output at TP=2 with speculation is token-identical to one rank without it: EAGLE-3 chain and tree and
n-gram, batched with requests of other lengths, and under chunked prefill, the prefix cache and preemption; a tree
whose right token is a runner-up moves that node's K/V on both ranks; sampled output keeps the target's
distribution."""
from __future__ import annotations

from collections import Counter

import pytest

from kestrel import LLM, SamplingParams
from kestrel.config import DEFAULT_DRAFTER_DIR
from tests.test_spec_tree import RunnerUpOracle
from tests.test_speculative import (PROMPTS, K, bucketed_tv, check_identical, chi_squared_p_value, greedy,
                                    mixed_params, reference, token_ids)  # noqa: F401 - reference: a fixture

TP = 2
CONFIGS = {
    "eagle3": {"method": "eagle3", "model": str(DEFAULT_DRAFTER_DIR), "num_speculative_tokens": K, "adaptive": False},
    "eagle3-tree": {"method": "eagle3", "model": str(DEFAULT_DRAFTER_DIR), "num_speculative_tokens": K, "topk": 3,
                    "adaptive": False},
    "ngram": {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
              "adaptive": False},
}


def tp_llm(speculative_config: dict, **kw) -> LLM:
    llm = LLM(device="cpu", tensor_parallel_size=TP, speculative_config=speculative_config, **kw)
    assert llm.engine.runner.tp.size == TP
    return llm


@pytest.mark.slow   # starts a rank's process
@pytest.mark.parametrize("method", list(CONFIGS))
def test_greedy_at_tp2_with_speculation_is_token_identical_to_one_rank(method, reference):
    """Also the same drafts as one rank drafts: the same accepted counts at every position (the drafter on rank 0
    reads the same hidden states and the whole embedding table, gathered from the ranks' shards)."""
    one_rank = LLM(device="cpu", speculative_config=CONFIGS[method])
    check_identical(one_rank, PROMPTS, mixed_params(len(PROMPTS)), reference)
    llm = tp_llm(CONFIGS[method])
    try:
        check_identical(llm, PROMPTS, mixed_params(len(PROMPTS)), reference)
        c = llm.engine.spec.counters
        assert c.num_accepted_tokens > 0, c   # accepted runs committed, not only rejections
        assert c == one_rank.engine.spec.counters
    finally:
        llm.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("method", list(CONFIGS))
def test_chunked_prefill_prefix_cache_and_preemption_at_tp2(method):
    """Twice through the same prompts (the second run hits the prefix cache), in 16-token prefill chunks, with a KV
    cache so small that sequences are preempted, recomputed, and their drafter state rebuilt."""
    prompts = [p * 3 for p in PROMPTS[:12]]
    params = [greedy(40)] * len(prompts)
    kw = dict(max_num_batched_tokens=16, num_gpu_blocks_override=24)
    want = token_ids(LLM(device="cpu", **kw).generate(prompts, params))
    llm = tp_llm(CONFIGS[method], **kw)
    try:
        for _ in range(2):
            check_identical(llm, prompts, params, want)
        assert llm.engine.scheduler.num_preemptions > 0, "the cache was meant to force preemption"
        assert llm.engine.prefix_cache.stats.hit_tokens > 0
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_a_right_runner_up_moves_its_kv_on_every_rank():
    """The true token at rank 1 of every tree step: only depth 1 can accept, its K/V is moved from cache index
    start + 2 to start + 1, and the next steps attend over it on both ranks (rank 1 holds half of each layer's KV
    heads: a move on rank 0 alone changes the tokens)."""
    prompts = PROMPTS[:6]
    params = greedy(1 + 5 * (K + 1))
    plain = LLM(device="cpu").generate(prompts, params)
    llm = tp_llm(CONFIGS["eagle3-tree"])
    try:
        vocab = llm.engine.model_config.vocab_size
        llm.engine.spec.proposer = RunnerUpOracle([o.prompt_token_ids + o.outputs[0].token_ids for o in plain], 1,
                                                  vocab)
        assert token_ids(llm.generate(prompts, params)) == token_ids(plain)
        c = llm.engine.spec.counters
        assert c.num_drafts > 0 and c.accepted_per_pos == [c.num_drafts] + [0] * (K - 1), c
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_sampling_at_tp2_keeps_the_target_distribution():
    """1,000 samples of the first 3 tokens at temperature 1, EAGLE-3 at TP=2 against one rank without speculation:
    each position passes a chi-squared homogeneity test at p > 0.001 and its bucketed total variation stays under
    0.1 (test_speculative.py's test at 1,000 samples)."""
    prompt = "red green blue red green blue red green"
    n = 1000
    plain = token_ids(LLM(device="cpu", max_num_seqs=256).generate(
        [prompt] * n, [SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True, seed=i) for i in range(n)]))
    llm = tp_llm(CONFIGS["eagle3"], max_num_seqs=256)
    try:
        spec = token_ids(llm.generate([prompt] * n, [SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True,
                                                                    seed=10_000 + i) for i in range(n)]))
        c = llm.engine.spec.counters
        assert c.num_draft_tokens > 0 and c.num_accepted_tokens > 0, c
    finally:
        llm.shutdown()
    for pos in range(3):
        a, b = Counter(t[pos] for t in plain), Counter(t[pos] for t in spec)
        assert chi_squared_p_value(a, b) > 1e-3, f"position {pos}"
        assert bucketed_tv(a, b) < 0.1, f"position {pos}"
