"""Every road through the runner (eager, decode graphs, prefill graphs) runs the same model forward on a
ForwardBatch: a linear layer's method is called on each of them, and each returns the same ForwardOutput
(logits, argmax tokens where a graph computed them, the hidden states entering chosen layers). The graph
runners' bodies run eagerly on the CPU here; their host-side bookkeeping is the real one."""
from __future__ import annotations

import pytest
import torch

from kestrel import LLM, SamplingParams
from kestrel.batch import SequenceChunk
from kestrel.forward.decode_graphs import DecodeGraphs
from kestrel.forward.prefill_graphs import PrefillGraphs
from kestrel.layers.linear import LinearBase, LinearMethod
from tests.tolerances import scaled

TOL = dict(atol=1e-5, rtol=1e-5)   # float32; atol for values of order one, scaled() grows it with the reference

PROMPTS = ["def add(a, b):", "import os\nimport sys\n", "class Stack:\n    def push(self, x):"]


class RecordingMethod(LinearMethod):
    """The plain method, recording which road each call came from."""

    def __init__(self) -> None:
        self.road = "eager"
        self.calls: list[tuple[str, int]] = []

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        self.calls.append((self.road, x.shape[0]))
        return super().apply(layer, x)


def _on_road(method: RecordingMethod, road: str, fn):
    def wrapped(*args, **kwargs):
        method.road = road
        try:
            return fn(*args, **kwargs)
        finally:
            method.road = "eager"
    return wrapped


@pytest.mark.slow
def test_a_linear_method_is_called_on_eager_decode_graph_and_prefill_graph_steps(checkpoint_factory):
    path = str(checkpoint_factory("llama"))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    kw = dict(device="cpu", block_size=4, max_num_batched_tokens=32)
    expected = [o.outputs[0].token_ids for o in LLM(model=path, **kw).generate(PROMPTS, params)]
    llm = LLM(model=path, **kw)
    runner = llm.engine.runner
    stub = RecordingMethod()
    runner.model.layers[1].mlp.down_proj.method = stub            # one layer's method, swapped
    runner.graphs = DecodeGraphs(runner, max_bs=4, max_blocks_per_seq=64, max_rows=8)
    runner.prefill_graphs = PrefillGraphs(runner, max_blocks_per_seq=64, max_tokens=32)
    runner.graphs.launch = _on_road(stub, "decode_graph", runner.graphs.launch)
    runner.prefill_graphs.run = _on_road(stub, "prefill_graph", runner.prefill_graphs.run)
    got = [llm.generate(p, params)[0].outputs[0].token_ids for p in PROMPTS]   # lone prompts: prefill graphs
    got_batched = [o.outputs[0].token_ids for o in llm.generate(PROMPTS + ["x" * 40], params)]  # 40 > 32: eager
    assert got == expected and got_batched[:3] == expected
    roads = {road for road, _ in stub.calls}
    assert roads == {"eager", "decode_graph", "prefill_graph"}, roads
    # the decode graph's body runs on its padded bucket; the prefill graph's on its padded token count
    assert {rows for road, rows in stub.calls if road == "prefill_graph"} <= {16, 32}
    # every bucket's logits are rows of one [max_bs, vocab] float32 buffer: a graph keeps its outputs alive, so
    # per-bucket logits would hold sum(buckets) rows of the vocabulary (CUDA graph memory)
    graphs = runner.graphs
    assert len(graphs.outputs) >= 2, graphs.outputs.keys()
    assert graphs.logits_buffer.shape == (4, runner.cfg.vocab_size) and graphs.logits_buffer.dtype == torch.float32
    assert {out.logits.data_ptr() for out in graphs.outputs.values()} == {graphs.logits_buffer.data_ptr()}


def test_every_road_returns_the_hidden_states_of_the_chosen_layers(checkpoint_factory):
    llm = LLM(model=str(checkpoint_factory("qwen3")), device="cpu", block_size=4)
    engine, runner = llm.engine, llm.engine.runner
    runner.capture_hidden_layers = (0, 1)
    tokens = llm.tokenizer.encode("def add(a, b):\n    return")
    blocks = engine.pool.allocate(-(-(len(tokens) + 1) // 4))
    prompt = SequenceChunk(0, tokens, 0, blocks)
    eager = runner.execute([prompt])
    assert eager.tokens is None and set(eager.hidden_states) == {0, 1}
    assert eager.hidden_states[1].shape == (len(tokens), runner.cfg.hidden_size)

    runner.prefill_graphs = PrefillGraphs(runner, max_blocks_per_seq=16, max_tokens=32)
    graphed = runner.execute([prompt])
    assert graphed.tokens is not None
    for layer in (0, 1):
        torch.testing.assert_close(graphed.hidden_states[layer], eager.hidden_states[layer],
                                   **scaled(TOL, eager.hidden_states[layer]))
    torch.testing.assert_close(graphed.logits, eager.logits, **scaled(TOL, eager.logits))

    step = SequenceChunk(0, [int(eager.logits.argmax())], len(tokens), blocks)
    runner.prefill_graphs = None
    decode_eager = runner.execute([step])
    runner.graphs = DecodeGraphs(runner, max_bs=2, max_blocks_per_seq=16, max_rows=4)
    decode_graphed = runner.execute([step])
    assert decode_graphed.tokens.tolist() == [int(decode_eager.logits.argmax())]
    for layer in (0, 1):
        assert decode_graphed.hidden_states[layer].shape == (1, runner.cfg.hidden_size)
        torch.testing.assert_close(decode_graphed.hidden_states[layer], decode_eager.hidden_states[layer],
                                   **scaled(TOL, decode_eager.hidden_states[layer]))
