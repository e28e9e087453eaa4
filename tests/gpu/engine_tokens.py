"""Greedy tokens of a CUDA engine under given environment switches: the A/B helper of the fast-path GPU tests."""
from __future__ import annotations

from kestrel import LLM, SamplingParams
from kestrel.envs import switches

PROMPTS = ["def add(a, b):\n    return a + b\n", "import os", "x = [i * i for i in range(10)]\nprint(",
           "class Stack:\n    def __init__(self):"]


def greedy_tokens(path: str | None, monkeypatch, env: dict[str, str], max_tokens: int = 24,
                  **kw) -> list[list[int]]:
    """PROMPTS through a fresh engine (graphs up to batch 8) with `env` set; path None = the default model."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    switches.cache_clear()   # the engine reads them at its start
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    llm = LLM(model=path, device="cuda", cuda_graph_max_bs=8, max_num_seqs=8, **kw)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


def routed_tokens_on_and_off(path: str, monkeypatch, module, function: str, switch: str, on: str, off: str,
                             **kw) -> tuple[list[list[int]], list[list[int]]]:
    """Greedy tokens with env `switch` at `on` and at `off`; asserts that with it on, decode went through
    module.function (counted by a wrapper installed for the `on` run)."""
    tokens_off = greedy_tokens(path, monkeypatch, {switch: off}, **kw)
    calls = []
    launch = getattr(module, function)
    monkeypatch.setattr(module, function, lambda *a, **k: calls.append(1) or launch(*a, **k))
    tokens_on = greedy_tokens(path, monkeypatch, {switch: on}, **kw)
    assert calls, f"{switch}={on} did not route decode through {module.__name__}.{function}"
    return tokens_on, tokens_off


def graph_head_keeps_tokens(checkpoint_factory, arch: str | None) -> bool:
    """Whether greedy tokens are identical with the decode graphs' fused head and argmax (the default on CUDA)
    and with their torch ops (`DecodeGraphs(fused=False)`, captured into the same engine): a random `arch`
    checkpoint in bf16, or the default model for None."""
    from kestrel.forward.decode_graphs import DecodeGraphs

    path = str(checkpoint_factory(arch)) if arch else None
    kw = {"dtype": "bfloat16"} if arch else {}
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    llm = LLM(model=path, device="cuda", cuda_graph_max_bs=8, max_num_seqs=8, **kw)
    runner = llm.engine.runner
    assert runner.graphs is not None and runner.graphs.argmax_scratch is not None, "fused graphs expected"
    fused = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    graphs = runner.graphs
    plain = DecodeGraphs(runner, graphs.max_bs, graphs.tables.shape[1], graphs.max_rows, fused=False)
    plain.capture()
    runner.graphs = plain
    return fused == [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
