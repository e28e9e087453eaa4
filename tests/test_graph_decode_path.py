"""The CUDA-graph decode path's host bookkeeping (packed inputs, persistent block-table rows, padding), run on the
CPU by executing the graph body eagerly: it must produce exactly the eager engine's tokens."""
from __future__ import annotations

import pytest

from kestrel import LLM, SamplingParams
from kestrel.forward.decode_graphs import DecodeGraphs, batch_size_buckets
from kestrel.forward.prefill_graphs import PrefillGraphs
from tests.tolerances import scaled

PROMPTS = ["import os", "def f(x):\n    return x", "class A:\n    pass\n" * 3, "x = 1\n" * 7, "print(1)"] * 3


def test_bucket_ladder():
    assert batch_size_buckets(256)[:6] == [1, 2, 4, 8, 16, 32] and batch_size_buckets(256)[-1] == 256
    assert batch_size_buckets(20) == [1, 2, 4, 8, 16, 20]


@pytest.mark.slow
def test_lone_sequences_pad_up_to_the_smallest_captured_bucket(checkpoint_factory):
    """With 8 rows the smallest bucket, batches of 1-3 replay the 8-row graph body, padding included, with the
    eager engine's tokens."""
    path = str(checkpoint_factory("llama"))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    eager = LLM(model=path, device="cpu").generate(PROMPTS[:3], params)
    llm = LLM(model=path, device="cpu")
    runner = llm.engine.runner
    runner.graphs = DecodeGraphs(runner, max_bs=16, max_blocks_per_seq=32, max_rows=16)
    runner.graphs.buckets = [8, 16]
    graphed = [llm.generate(p, params)[0] for p in PROMPTS[:3]]   # one at a time: batch 1 in the 8-row body
    assert [o.outputs[0].token_ids for o in graphed] == [o.outputs[0].token_ids for o in eager]


def test_graph_decode_path_matches_eager_under_preemption(checkpoint_factory):
    path = str(checkpoint_factory("llama"))
    kw = dict(device="cpu", block_size=4, num_gpu_blocks_override=20, max_num_batched_tokens=24, max_num_seqs=8,
              disable_prefix_cache=True)
    params = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)
    eager = LLM(model=path, **kw).generate(PROMPTS, params)
    llm = LLM(model=path, **kw)
    runner = llm.engine.runner
    # 4 graph rows per batch at most and only 8 persistent rows: rows are reclaimed and rewritten.
    runner.graphs = DecodeGraphs(runner, max_bs=4, max_blocks_per_seq=64, max_rows=8)
    calls = []
    original = runner.graphs.launch
    runner.graphs.launch = lambda chunks: calls.append(len(chunks)) or original(chunks)
    graphed = llm.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in graphed] == [o.outputs[0].token_ids for o in eager]
    assert llm.engine.scheduler.num_preemptions > 0 and calls and max(calls) <= 4


def test_graph_path_sampling_and_logprobs_still_work(checkpoint_factory):
    llm = LLM(model=str(checkpoint_factory("llama")), device="cpu")
    runner = llm.engine.runner
    params = SamplingParams(max_tokens=6, temperature=0.8, seed=5, logprobs=2, ignore_eos=True)
    eager = llm.generate(PROMPTS[:3], params)
    runner.graphs = DecodeGraphs(runner, max_bs=8, max_blocks_per_seq=32, max_rows=16)
    graphed = llm.generate(PROMPTS[:3], params)
    assert [o.outputs[0].token_ids for o in graphed] == [o.outputs[0].token_ids for o in eager]
    assert all(len(o.outputs[0].logprobs) == 6 for o in graphed)


@pytest.mark.slow
def test_padded_prefill_graph_path_matches_eager(checkpoint_factory):
    path = str(checkpoint_factory("qwen3"))
    kw = dict(device="cpu", block_size=4, max_num_batched_tokens=32)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    eager = [LLM(model=path, **kw).generate(p, params)[0] for p in PROMPTS[:5]]
    llm = LLM(model=path, **kw)
    runner = llm.engine.runner
    runner.prefill_graphs = PrefillGraphs(runner, max_blocks_per_seq=64, max_tokens=32)
    assert runner.prefill_graphs.buckets == [16, 32]
    runner.prefill_graphs.capture(dry_run=True)   # capture's own inputs must be valid for every bucket
    calls = []
    original = runner.prefill_graphs.run
    runner.prefill_graphs.run = lambda chunk: calls.append(len(chunk.tokens)) or original(chunk)
    graphed = [llm.generate(p, params)[0] for p in PROMPTS[:5]]   # one at a time: the lone-prompt path
    assert [o.outputs[0].token_ids for o in graphed] == [o.outputs[0].token_ids for o in eager]
    assert len(calls) >= 4


def test_prefill_buckets_fit_the_block_table(checkpoint_factory):
    llm = LLM(model=str(checkpoint_factory("llama")), device="cpu", block_size=4, max_model_len=40)
    runner = llm.engine.runner
    graphs = PrefillGraphs(runner, max_blocks_per_seq=10, max_tokens=8192)
    assert graphs.buckets == [16, 32]             # 40-token context: 64+ token buckets cannot exist
    graphs.capture(dry_run=True)


def check_verify_step(llm, graphs: DecodeGraphs, prompts: list[str], truth: list[list[int]], atol: float) -> None:
    """Prefill the prompts (a greedy SamplingParams of >= 4 tokens), then run one verify step through `graphs`
    (Q = 3: each sequence's first output token plus the next two true tokens as drafts). The argmax at every query
    must be the next true token and the logits those of a plain forward of the same tokens."""
    import torch

    from kestrel.batch import SequenceChunk, build_forward_batch
    engine, runner, q = llm.engine, llm.engine.runner, graphs.query_len
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    seqs = []
    for i, prompt in enumerate(prompts):   # prefill each prompt: its first output token is not in the cache yet
        engine.add_request(f"verify{i}", llm.tokenizer.encode(prompt), params)
        seqs.append(engine.sequences(f"verify{i}")[0])
    while any(seq.num_output_tokens == 0 for seq in seqs):
        engine.step()
    engine._resolve_inflight()   # the overlap schedule may hold a launched step: make every token real
    for seq, want in zip(seqs, truth):
        del seq.output_token_ids[1:]   # and forget it: the verify step starts after the first output token
        seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens - 1)
        assert seq.output_token_ids == want[:1] and not seq.is_finished
        need = -(-(seq.num_tokens - 1 + q) // engine.pool.block_size) - len(seq.block_ids)
        seq.block_ids.extend(engine.pool.allocate(max(need, 0)))
    queries = [t[:q] for t in truth]
    out = graphs.launch([SequenceChunk(seq.seq_id, query, seq.num_tokens - 1, seq.block_ids, seq.num_preemptions)
                         for seq, query in zip(seqs, queries)])
    logits, tokens = out.logits, out.tokens
    assert tokens.view(len(seqs), q).tolist() == [t[1:q + 1] for t in truth]
    batch = build_forward_batch(queries, [seq.num_tokens - 1 for seq in seqs], [seq.block_ids for seq in seqs],
                                engine.pool.block_size)
    batch.logits_at = torch.arange(len(seqs) * q, device=logits.device)
    ref = runner.forward(batch).logits
    torch.testing.assert_close(logits, ref, **scaled(dict(atol=atol, rtol=atol), ref))


def test_fixed_query_length_runner_verifies_drafts_like_speculative_decoding(checkpoint_factory):
    """A runner of Q = 3 query tokens per sequence (a verify step: last token + 2 drafts), body run eagerly on the
    CPU, fed each sequence's true greedy continuation as drafts. Batch 3 pads to the 4-row bucket."""
    path = str(checkpoint_factory("llama"))
    kw = dict(device="cpu", block_size=4, disable_prefix_cache=True)
    prompts = PROMPTS[:3]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    truth = [o.outputs[0].token_ids for o in LLM(model=path, **kw).generate(prompts, params)]
    llm = LLM(model=path, **kw)
    graphs = DecodeGraphs(llm.engine.runner, max_bs=4, max_blocks_per_seq=64, max_rows=8, query_len=3)
    check_verify_step(llm, graphs, prompts, truth, atol=1e-5)
