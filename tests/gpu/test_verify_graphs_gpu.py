"""CUDA graphs for steps of a fixed number of query tokens per sequence (speculative verification): a captured
Q = 3 runner, replayed, gives the eager forward's logits and, fed the true greedy continuation as drafts, the next
true token at every query position."""
from __future__ import annotations

import pytest
import torch

from kestrel import LLM, SamplingParams
from kestrel.engine.batch import build_forward_batch
from kestrel.engine.cuda_graphs import CudaGraphRunner

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_captured_verify_graph_matches_eager(checkpoint_factory):
    path = str(checkpoint_factory("qwen3"))
    prompts = ["def add(a, b):", "import os", "class Stack:"]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    kw = dict(device="cuda", dtype="float32", cuda_graph_max_bs=8, max_num_seqs=8, gpu_memory_utilization=0.3)
    llm = LLM(model=path, **kw)
    truth = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    engine, runner, q = llm.engine, llm.engine.runner, 3
    verify = CudaGraphRunner(runner, max_bs=4, max_blocks_per_seq=runner.graphs.tables.shape[1], max_rows=8,
                             query_len=q)
    verify.pool = runner.graphs.pool   # one memory pool with the decode graphs
    verify.capture()
    assert verify.graphs, "nothing captured"
    seqs = []
    for i, prompt in enumerate(prompts):
        engine.add_request(f"v{i}", llm.tokenizer.encode(prompt), params)
        seqs.append(engine.sequences(f"v{i}")[0])
    while any(seq.num_output_tokens == 0 for seq in seqs):
        engine.step()
    engine._resolve_inflight()   # the overlap schedule may hold a launched step: make every token real
    for seq in seqs:
        del seq.output_token_ids[1:]
        seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens - 1)
        need = -(-(seq.num_tokens - 1 + q) // engine.pool.block_size) - len(seq.block_ids)
        seq.block_ids.extend(engine.pool.allocate(max(need, 0)))
    queries = [t[:3] for t in truth]
    logits, tokens = verify.launch_queries(seqs, queries)
    assert tokens.view(len(seqs), q).tolist() == [t[1:4] for t in truth]
    batch = build_forward_batch(queries, [seq.num_tokens - 1 for seq in seqs], [seq.block_ids for seq in seqs],
                                engine.pool.block_size)
    batch.logits_at = torch.arange(len(seqs) * q)
    torch.testing.assert_close(logits, runner.forward(batch).logits, atol=1e-4, rtol=1e-4)
