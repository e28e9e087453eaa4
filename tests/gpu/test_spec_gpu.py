"""Speculative decoding on CUDA, every road captured: verify graphs and the drafter's graphs (EAGLE-3, an
untrained drafter) keep greedy output token-identical to decoding without speculation, float32, batched with
requests of other lengths; the captured drafter drafts what the eager drafter drafts."""
from __future__ import annotations

import pytest
import torch

from kestrel import LLM
from tests.test_speculative import PROMPTS, drafter_dir, mixed_params, spec_configs, token_ids  # noqa: F401

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

KW = dict(device="cuda", dtype="float32", gpu_memory_utilization=0.2, max_num_seqs=32, cuda_graph_max_bs=32)


def test_captured_drafter_and_verify_graphs_keep_greedy_output(drafter_dir):
    params = mixed_params(len(PROMPTS))
    plain = LLM(**KW)
    want = token_ids(plain.generate(PROMPTS, params))
    del plain
    torch.cuda.empty_cache()
    drafts = {}
    for captured in (True, False):
        llm = LLM(speculative_config=spec_configs(drafter_dir)["eagle3"], **KW)
        proposer = llm.engine.spec.proposer
        assert llm.engine.runner.verify_graphs is not None and proposer.graphs is not None, "nothing captured"
        if not captured:
            proposer.graphs = None   # the eager drafter after the same verify graphs
        seen, asked = [], proposer.drafts
        proposer.drafts = lambda seq, k: seen.append(asked(seq, k)) or seen[-1]
        assert token_ids(llm.generate(PROMPTS, params)) == want
        assert llm.engine.spec.counters.num_draft_tokens > 0
        drafts[captured] = seen
        del llm
        torch.cuda.empty_cache()
    assert sum(len(d) for d in drafts[True]) > 100
    same = sum(a == b for a, b in zip(drafts[True], drafts[False]))
    assert same >= 0.95 * len(drafts[False]), f"{same} of {len(drafts[False])} drafts agree"


def test_captured_tree_verify_and_drafter_graphs_keep_greedy_output(drafter_dir):
    """Tree drafting on CUDA: the Triton extend kernel's tree mask inside captured verify graphs, the drafter's
    top-k graphs and the accepted path's K/V moves."""
    params = mixed_params(len(PROMPTS))
    plain = LLM(**KW)
    want = token_ids(plain.generate(PROMPTS, params))
    del plain
    torch.cuda.empty_cache()
    config = dict(spec_configs(drafter_dir)["eagle3"], topk=3)
    llm = LLM(speculative_config=config, **KW)
    assert llm.engine.runner.verify_graphs is not None and llm.engine.spec.proposer.graphs is not None
    assert llm.engine.runner.verify_graphs.tree_mask is not None
    assert token_ids(llm.generate(PROMPTS, params)) == want
    assert llm.engine.spec.counters.num_drafts > 0
