"""Tree drafting (forward/draft_tree.py): the drafter's top-k candidates at each chain step, verified in one step
with a tree attention mask. On the default model (CPU, float32) greedy output stays token-identical to decoding
without speculation (batched, alone, with the prefix cache, chunked prefill and preemption, and on the graph
roads); a runner-up that is right is accepted and its K/V moved into place."""
from __future__ import annotations

import pytest
import torch

from kestrel import LLM
from kestrel.speculative.proposer import Proposer
from kestrel.forward.draft_tree import draft_tree
from tests.test_speculative import (PROMPTS, K, check_identical, drafter_dir, greedy, mixed_params,  # noqa: F401
                                    reference, token_ids)

TOPK = 3


def tree_config(drafter: str, **extra) -> dict:
    return {"method": "eagle3", "model": drafter, "num_speculative_tokens": K, "topk": TOPK, "adaptive": False,
            **extra}


def test_tree_shape_mask_and_budget():
    tree = draft_tree(3, 3)
    assert tree.size == 9 and tree.depths == [0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert tree.parents == (-1, -1, -1, 0, 0, 0, 3, 3, 3)   # every step hangs under the chain's node before it
    mask = tree.mask()
    assert mask[0].tolist() == [True] + [False] * 9                      # the root sees itself
    assert mask[5].tolist() == [True, True, False, False, False, True] + [False] * 4   # (2,1): root, (1,0), self
    assert mask[8].tolist() == [True, True, False, False, True, False, False, False, True, False]   # (3,1)
    pruned = draft_tree(3, 3, budget=5)   # the chain first, then the runners-up nearest the root
    assert pruned.nodes == ((1, 0), (1, 1), (1, 2), (2, 0), (3, 0))
    assert all(pruned.nodes[p] == (d - 1, 0) for (d, _), p in zip(pruned.nodes, pruned.parents) if p >= 0)
    with pytest.raises(ValueError):
        draft_tree(3, 3, budget=10)


@pytest.mark.slow
def test_tree_greedy_batched_and_alone_is_token_identical(drafter_dir, reference):
    llm = LLM(device="cpu", speculative_config=tree_config(drafter_dir))
    check_identical(llm, PROMPTS, mixed_params(len(PROMPTS)), reference)
    params = mixed_params(len(PROMPTS))
    for i in (0, 15, 21):
        check_identical(llm, [PROMPTS[i]], [params[i]], [reference[i]])


@pytest.mark.slow
def test_tree_with_prefix_cache_chunked_prefill_and_preemption(drafter_dir):
    prompts = [p * 3 for p in PROMPTS[:12]]
    params = [greedy(40)] * len(prompts)
    kw = dict(device="cpu", max_num_batched_tokens=16, num_gpu_blocks_override=24)
    want = token_ids(LLM(**kw).generate(prompts, params))
    llm = LLM(speculative_config=tree_config(drafter_dir), **kw)
    for _ in range(2):
        check_identical(llm, prompts, params, want)
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.prefix_cache.stats.hit_tokens > 0


@pytest.mark.slow
def test_tree_on_the_graph_roads_is_token_identical(drafter_dir, reference):
    """The GPU's roads on the CPU (bodies run eagerly): a tree verify runner of size + 1 query tokens with the
    tree's positions and mask, then the drafter's one-launch extend and top-k drafting."""
    from kestrel.forward.decode_graphs import DecodeGraphs
    from kestrel.forward.drafter_graphs import DrafterGraphs

    llm = LLM(device="cpu", speculative_config=tree_config(drafter_dir))
    runner, spec = llm.engine.runner, llm.engine.spec
    runner.verify_graphs = DecodeGraphs(runner, max_bs=32, max_blocks_per_seq=128, max_rows=256,
                                        query_len=spec.tree.size + 1, tree=(spec.tree.depths, spec.tree.mask()))
    proposer = spec.proposer
    proposer.graphs = DrafterGraphs(proposer.drafter, type(runner.backend)(), proposer.kv, runner.verify_graphs, K,
                                    TOPK)
    launches, runs = [], []
    verify_launch, drafter_run = runner.verify_graphs.launch, proposer.graphs.run
    runner.verify_graphs.launch = lambda chunks: launches.append(len(chunks)) or verify_launch(chunks)
    proposer.graphs.run = lambda rows, output: runs.append(len(rows)) or drafter_run(rows, output)
    check_identical(llm, PROMPTS, mixed_params(len(PROMPTS)), reference)
    assert launches and runs


class RunnerUpOracle(Proposer):
    """Knows the true continuation; puts it at rank `rank` of every step's candidates (the other ranks wrong)."""

    def __init__(self, sequences: list[list[int]], rank: int, vocab: int) -> None:
        self.sequences, self.rank, self.vocab = sequences, rank, vocab

    def drafts(self, seq, k: int) -> list[int]:
        return []

    def candidates(self, seq) -> list[list[int]] | None:
        tokens = seq.token_ids()
        for full in self.sequences:
            if full[:len(tokens)] == tokens:
                truth = full[len(tokens):len(tokens) + K]
                if len(truth) < K:
                    return None
                steps = []
                for t in truth:
                    wrong = [(t + 1 + i) % self.vocab for i in range(TOPK)]
                    steps.append(wrong[:self.rank] + [t] + wrong[self.rank + 1:])
                return steps
        return None


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_a_right_runner_up_is_accepted_and_its_kv_moved(drafter_dir, rank):
    """Rank 0 right: the whole chain is accepted (K drafts a step). Rank 1 or 2 right: only depth 1 can accept
    (a runner-up has no children), so one draft a step, and its K/V is moved from cache index start + 1 + rank to
    start + 1; the output staying identical shows the move."""
    prompts = PROMPTS[:6]
    params = greedy(1 + 5 * (K + 1))
    plain = LLM(device="cpu").generate(prompts, params)
    llm = LLM(device="cpu", speculative_config=tree_config(drafter_dir))
    vocab = llm.engine.model_config.vocab_size
    llm.engine.spec.proposer = RunnerUpOracle([o.prompt_token_ids + o.outputs[0].token_ids for o in plain], rank,
                                              vocab)
    assert token_ids(llm.generate(prompts, params)) == token_ids(plain)
    c = llm.engine.spec.counters
    assert c.num_drafts > 0
    want = [c.num_drafts] * K if rank == 0 else [c.num_drafts] + [0] * (K - 1)
    assert c.accepted_per_pos == want, c


@pytest.mark.slow
def test_tree_sampling_keeps_the_first_token_distribution(drafter_dir):
    """Temperature 1: the first two generated tokens (the second one verified against the tree) have the same
    distribution with tree speculation as without (bucketed total variation, 1,000 samples each)."""
    from collections import Counter

    from kestrel import SamplingParams
    from tests.test_speculative import bucketed_tv

    prompt = "The quick brown fox"
    n = 1000
    params = [SamplingParams(max_tokens=1 + K + 1, temperature=1.0, ignore_eos=True, seed=i) for i in range(n)]
    plain = LLM(device="cpu").generate([prompt] * n, params)
    llm = LLM(device="cpu", speculative_config=tree_config(drafter_dir))
    spec = llm.generate([prompt] * n, [SamplingParams(max_tokens=1 + K + 1, temperature=1.0, ignore_eos=True,
                                                      seed=10_000 + i) for i in range(n)])
    assert llm.engine.spec.counters.num_drafts > 0
    for j in (1, 2):
        a = Counter(tuple(o.outputs[0].token_ids[:j + 1]) for o in plain)
        b = Counter(tuple(o.outputs[0].token_ids[:j + 1]) for o in spec)
        assert bucketed_tv(a, b) < 0.1, (j, bucketed_tv(a, b))
