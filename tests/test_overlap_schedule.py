"""The overlap schedule (engine/overlap.py): decode step N+1 launched before step N's tokens are read back must
give exactly what the synchronous schedule gives, whatever stops, aborts and sampling do. The CUDA-graph decode
path runs its body eagerly on the CPU here, so the placeholder / input_src bookkeeping is the real one."""
from __future__ import annotations

import pytest

import random

from kestrel import LLM, SamplingParams
from kestrel.engine.overlap import PLACEHOLDER
from kestrel.forward.decode_graphs import DecodeGraphs


def _llm(path: str, overlap: bool, **kw) -> tuple[LLM, list[int]]:
    llm = LLM(model=path, device="cpu", disable_overlap_schedule=not overlap, **kw)
    runner = llm.engine.runner
    runner.graphs = DecodeGraphs(runner, max_bs=8, max_blocks_per_seq=64, max_rows=12)
    overlapped = []   # rows of each launch that fed from the previous launch's device tokens
    original = runner.graphs.launch

    def launch(chunks):
        overlapped.append(sum(1 for c in chunks if c.tokens[-1] < 0))   # fed by the previous launch's tokens
        return original(chunks)
    runner.graphs.launch = launch
    return llm, overlapped


@pytest.mark.slow
def test_overlap_matches_synchronous_schedule_with_stops_and_sampling(checkpoint_factory):
    path = str(checkpoint_factory("llama"))
    rng = random.Random(0)
    probe, _ = _llm(path, overlap=False)
    vocab = probe.engine.model_config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(3, 20))] for _ in range(10)]
    free_run = probe.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    params = []
    for i, out in enumerate(free_run):
        tokens = out.outputs[0].token_ids
        kind = i % 5
        if kind == 0:     # stops on a token it will produce (the step after it was already launched)
            params.append(SamplingParams(max_tokens=16, temperature=0, stop_token_ids=[tokens[5]]))
        elif kind == 1:   # the same, but min_tokens forbids stopping early (that step needs masked logits)
            params.append(SamplingParams(max_tokens=16, temperature=0, stop_token_ids=[tokens[2]], min_tokens=4))
        elif kind == 2:   # sampled rows: drawn on the device after the graph, overlapped like greedy ones
            params.append(SamplingParams(max_tokens=3, temperature=0.9, seed=i, ignore_eos=True))
        elif kind == 3:   # text stop: finish_sample between steps, with a step in flight
            params.append(SamplingParams(max_tokens=16, temperature=0, stop=[probe.tokenizer.decode(tokens[4:6])]))
        else:
            params.append(SamplingParams(max_tokens=rng.randint(1, 14), temperature=0, ignore_eos=True))
    sync_llm, _ = _llm(path, overlap=False)
    expected = sync_llm.generate(prompts, params)
    llm, overlapped = _llm(path, overlap=True)
    got = llm.generate(prompts, params)
    for g, e in zip(got, expected):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids
        assert g.outputs[0].text == e.outputs[0].text
        assert g.outputs[0].finish_reason == e.outputs[0].finish_reason
    assert sum(overlapped) > 20, "the overlap schedule never fed a row from the previous launch"
    engine = llm.engine
    assert engine._inflight is None and not engine.has_unfinished()
    engine.prefix_cache.reset()
    assert engine.pool.num_free == engine.pool.num_blocks


@pytest.mark.slow
def test_abort_with_a_step_in_flight(checkpoint_factory):
    path = str(checkpoint_factory("llama"))
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    sync_llm, _ = _llm(path, overlap=False)
    expected = [o.outputs[0].token_ids for o in sync_llm.generate(prompts, params)]
    llm, overlapped = _llm(path, overlap=True)
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(3)}
    finished = {}
    steps = 0
    while engine.has_unfinished():
        for up in engine.step():
            got[up.request_id] += up.new_token_ids
            if up.finished:
                finished[up.request_id] = up.finish_reason
        steps += 1
        if steps == 5:
            assert engine._inflight is not None, "expected a decode step in flight"
            engine.abort_request("r1")
    assert finished == {"r0": "length", "r1": "abort", "r2": "length"}
    assert got["r0"] == expected[0] and got["r2"] == expected[2]
    assert got["r1"] == expected[1][: len(got["r1"])] and len(got["r1"]) < 12   # nothing after the abort
    assert PLACEHOLDER not in got["r1"] and sum(overlapped) > 0
    engine.prefix_cache.reset()
    assert engine.pool.num_free == engine.pool.num_blocks


@pytest.mark.slow
def test_sampled_rows_ride_the_overlap_and_draw_what_the_synchronous_schedule_draws(checkpoint_factory):
    """Seeded temperature / top-k / top-p / min-p rows: the device draw after each launch (written over the
    argmax, fed to the next launch) gives the synchronous schedule's tokens, and the rows are overlapped."""
    path = str(checkpoint_factory("llama"))
    prompts = [[5, 9, 11, 30], [7, 7, 8], [40, 41, 42, 43, 44, 45], [3, 4]]
    params = [SamplingParams(max_tokens=12, temperature=0.8, seed=1, ignore_eos=True),
              SamplingParams(max_tokens=9, temperature=1.1, top_k=20, seed=2, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.7, top_p=0.9, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)]   # a greedy row in the same batch
    sync_llm, _ = _llm(path, overlap=False)
    expected = sync_llm.generate(prompts, params)
    llm, overlapped = _llm(path, overlap=True)
    got = llm.generate(prompts, params)
    assert [g.outputs[0].token_ids for g in got] == [e.outputs[0].token_ids for e in expected]
    assert sum(overlapped) >= 3 * 8, "sampled rows were not fed from the previous launch's device tokens"
    assert llm.engine._inflight is None and not llm.engine.has_unfinished()
