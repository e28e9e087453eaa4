"""Warm-up (kestrel/forward/warm_up.py): its steps reach every integer class Triton specialises on (equals 1,
divisible by 16, neither) for the counts the scheduler decides, and every row count where a GEMM's tile table can
change; each step is one the engine could run (positions inside the model, blocks covering the context); and the
full warm-up run on a real runner leaves generation exactly as it was."""
from __future__ import annotations

import pytest

from kestrel import LLM, SamplingParams
from kestrel.forward.warm_up import class_matrix, row_ladder, warm_up, warm_up_steps


def integer_class(n: int) -> str:
    return "one" if n == 1 else "div16" if n % 16 == 0 else "other"


def counts(step, block_size):
    queries = [len(c.tokens) for c in step]
    return {"seqs": len(step), "tokens": sum(queries), "max_query": max(queries),
            "width": max(len(c.block_ids) for c in step), "logits": sum(c.wants_logits for c in step)}


@pytest.mark.parametrize("block_size, max_model_len", [(16, 4096), (4, 128), (16, 64)])
def test_the_class_matrix_reaches_every_class_of_every_count(block_size, max_model_len):
    seen: dict[str, set[str]] = {}
    for step in class_matrix(block_size, max_model_len):
        for name, n in counts(step, block_size).items():
            seen.setdefault(name, set()).add("zero" if n == 0 else integer_class(n))
    wide = max_model_len >= 15 * block_size + 1   # 16 context blocks fit the model
    for name in ("seqs", "tokens", "max_query"):
        assert seen[name] == {"one", "div16", "other"}, name
    assert seen["width"] == ({"one", "div16", "other"} if wide else {"one", "other"})
    assert seen["logits"] == {"zero", "one", "div16", "other"}


@pytest.mark.parametrize("max_tokens, max_model_len", [(8192, 131072), (8192, 2048), (3000, 4096), (64, 64)])
def test_the_row_ladder_reaches_each_power_of_two_its_successor_and_the_largest_step(max_tokens, max_model_len):
    totals = [sum(len(c.tokens) for c in step) for step in row_ladder(max_tokens, 16, max_model_len)]
    want = {r for i in range(5, 14) for r in (1 << i, (1 << i) + 1) if r <= max_tokens} | {max_tokens}
    assert sorted(totals) == sorted(want)
    assert all(len(step) >= 2 for step in row_ladder(max_tokens, 16, max_model_len))   # no lone prefill (a graph)


@pytest.mark.parametrize("block_size, max_tokens, max_model_len", [(16, 8192, 2048), (4, 64, 48), (16, 512, 100)])
def test_every_step_fits_the_model_and_its_blocks(block_size, max_tokens, max_model_len):
    for step in warm_up_steps(block_size, max_tokens, max_model_len):
        assert sum(len(c.tokens) for c in step) <= max(max_tokens, 16 * 16)
        for c in step:
            kv_len = c.start + len(c.tokens)
            assert 0 <= c.start and kv_len <= max_model_len
            assert len(c.block_ids) == -(-kv_len // block_size)


@pytest.mark.slow
def test_the_full_warm_up_runs_every_eager_step_and_changes_no_output(checkpoint_factory):
    path = str(checkpoint_factory("llama"))
    kw = dict(device="cpu", block_size=4, max_num_batched_tokens=64, max_model_len=96,
              kv_cache_memory=64 * 4 * 2 * 2 * 4 * 64)   # a small cache: the steps' blocks wrap around it
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = ["def add(a, b):", "import os\nimport sys\n"]
    expected = [o.outputs[0].token_ids for o in LLM(model=path, **kw).generate(prompts, params)]
    llm = LLM(model=path, **kw)
    runner = llm.engine.runner
    steps = warm_up_steps(4, 64, 96)
    assert warm_up(runner, 4, 64, 96, full=True) == len(steps) > 40   # on the CPU no graph replays any of them
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
