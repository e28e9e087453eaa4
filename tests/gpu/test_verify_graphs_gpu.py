"""CUDA graphs for steps of a fixed number of query tokens per sequence (speculative verification): a captured
Q = 3 runner, replayed, gives the eager forward's logits and, fed the true greedy continuation as drafts, the next
true token at every query position."""
from __future__ import annotations

import pytest
import torch

from kestrel import LLM, SamplingParams
from kestrel.forward.decode_graphs import DecodeGraphs
from tests.test_graph_decode_path import check_verify_step

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_captured_verify_graph_matches_eager(checkpoint_factory):
    path = str(checkpoint_factory("qwen3"))
    prompts = ["def add(a, b):", "import os", "class Stack:"]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    kw = dict(device="cuda", dtype="float32", cuda_graph_max_bs=8, max_num_seqs=8, gpu_memory_utilization=0.3)
    llm = LLM(model=path, **kw)
    truth = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    runner = llm.engine.runner
    verify = DecodeGraphs(runner, max_bs=4, max_blocks_per_seq=runner.graphs.tables.shape[1], max_rows=8,
                             query_len=3)
    verify.pool = runner.graphs.pool   # one memory pool with the decode graphs
    verify.capture()
    assert verify.graphs, "nothing captured"
    check_verify_step(llm, verify, prompts, truth, atol=1e-4)
