"""The radix prefix cache inside the engine: same tokens with and without it, shared prompts computed once."""
from __future__ import annotations

import random

import pytest

from kestrel import LLM, SamplingParams
from kestrel.config import DEFAULT_MODEL_DIR

SYSTEM = "# A helper module.\nimport os\nimport sys\nimport json\n\n\ndef load(path):\n    with open(path) as f:\n"
PROMPTS = [SYSTEM + tail for tail in ("        return json.load(f)\n", "        data = f.read()\n",
                                        "        lines = f.readlines()\n", "        return f\n")]


def run(path, disable: bool, prompts, **kw):
    llm = LLM(model=str(path), device="cpu", block_size=4, disable_prefix_cache=disable, **kw)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    first = llm.generate(prompts[:1], params)                  # warms the cache with the shared prefix
    rest = llm.generate(prompts, params)
    return llm, first + rest


@pytest.mark.slow
@pytest.mark.parametrize("model", ["random", "default"])
def test_greedy_outputs_identical_with_and_without_cache(checkpoint_factory, model):
    if model == "default" and not (DEFAULT_MODEL_DIR / "config.json").is_file():
        pytest.skip("default model not present")
    path = checkpoint_factory("qwen3") if model == "random" else DEFAULT_MODEL_DIR
    llm_on, with_cache = run(path, False, PROMPTS)
    _, without = run(path, True, PROMPTS)
    assert [o.outputs[0].token_ids for o in with_cache] == [o.outputs[0].token_ids for o in without]
    hits = [o.num_cached_tokens for o in with_cache]
    assert hits[0] == 0 and all(h >= 4 * (len(llm_on.tokenizer.encode(SYSTEM)) // 4 - 1) for h in hits[2:])
    assert llm_on.engine.stats().prefix_cache_hits == sum(hits)


def test_n_samples_share_the_prompt_blocks(checkpoint_factory):
    llm = LLM(model=str(checkpoint_factory("llama")), device="cpu", block_size=4)
    prompt = llm.tokenizer.encode(SYSTEM)
    out = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=1.0, n=4, seed=3, ignore_eos=True))[0]
    full_blocks = 4 * ((len(prompt) - 1) // 4)
    assert out.num_cached_tokens in (0, full_blocks)
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits == 3 * full_blocks        # samples 1..3 reuse sample 0's prompt
    # Same seeds give the same samples with the cache off.
    off = LLM(model=str(checkpoint_factory("llama")), device="cpu", block_size=4, disable_prefix_cache=True)
    out_off = off.generate([prompt], SamplingParams(max_tokens=4, temperature=1.0, n=4, seed=3, ignore_eos=True))[0]
    assert [o.token_ids for o in out.outputs] == [o.token_ids for o in out_off.outputs]


@pytest.mark.slow
def test_cache_with_preemption_and_chunked_prefill_keeps_tokens_and_frees_blocks(checkpoint_factory):
    path = checkpoint_factory("llama")
    rng = random.Random(1)
    prompts = [rng.choice(PROMPTS) + f"x{i} = {i}\n" for i in range(8)]
    kw = dict(num_gpu_blocks_override=40, max_num_batched_tokens=16)
    on, with_cache = run(path, False, prompts, **kw)
    _, without = run(path, True, prompts, **kw)
    assert [o.outputs[0].token_ids for o in with_cache] == [o.outputs[0].token_ids for o in without]
    assert on.engine.scheduler.num_preemptions > 0
    on.engine.prefix_cache.reset()
    assert on.engine.pool.num_free == on.engine.pool.num_blocks
    on.engine.pool.check_invariants()
