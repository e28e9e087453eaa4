"""First traffic builds no kernels (issue 51: "first burst = warm"): after the engine reports ready, a burst of
mixed requests — prompt lengths from 1 to a few chunks, greedy and sampled rows, top-p / top-k / min-p, logprobs,
n > 1, batch sizes between the graph buckets — makes no Triton build (kernels/compile_watch.py counts them). A
failure lists each kernel and its specialisation: the shapes startup's warm-up must reach."""
from __future__ import annotations

import random

import pytest

from kestrel import LLM, SamplingParams


def _burst(vocab: int, seed: int = 0) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    lengths = [1, 2, 15, 16, 17, 100, 127, 128, 129, 300, 1000, 2049, 4100] + [rng.randint(1, 600) for _ in range(40)]
    out = []
    for i, n in enumerate(lengths):
        prompt = [rng.randrange(10, vocab) for _ in range(n)]
        kind = i % 5
        params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
                  SamplingParams(max_tokens=24, temperature=0.8, ignore_eos=True),
                  SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, top_k=40, ignore_eos=True),
                  SamplingParams(max_tokens=24, temperature=0.7, min_p=0.05, logprobs=3, ignore_eos=True),
                  SamplingParams(max_tokens=24, temperature=1.0, n=2, seed=i, ignore_eos=True)][kind]
        out.append((prompt, params))
    return out


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_a_mixed_burst_after_ready_builds_no_kernel(quantization):
    llm = LLM(model=None, device="cuda", quantization=quantization)
    try:
        engine = llm.engine
        requests = _burst(engine.model_config.vocab_size)
        for i, (prompt, params) in enumerate(requests):
            engine.add_request(f"r{i}", prompt, params)
        while engine.has_unfinished():
            engine.step()
        built = engine.compile_watch.after_ready()
        assert engine.stats().kernel_builds_after_ready == len(built)
        assert not built, "built after ready:\n" + "\n".join(f"{b.kernel} {b.signature[:300]}" for b in built)
    finally:
        llm.shutdown()
