"""LLM.generate's prompt forms (vLLM's TextPrompt / TokensPrompt dicts beside strings and token ids) and LLM's
lifetime: shutdown() and `del llm` give the engine's memory back."""
from __future__ import annotations

import gc
import weakref

import pytest

from kestrel import LLM, SamplingParams
from kestrel.errors import KestrelError

PROMPTS = ["def main(", "import os\nimport", "class Foo:"]


@pytest.fixture(scope="module")
def checkpoint(checkpoint_factory):
    return checkpoint_factory("llama")


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(model=str(checkpoint), device="cpu")


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=6)


def texts(outputs) -> list[str]:
    return [o.outputs[0].text for o in outputs]


def test_prompt_dicts_mixed_with_strings_and_ids_equal_the_plain_forms(llm):
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    plain = llm.generate(PROMPTS, greedy())
    mixed = llm.generate([{"prompt": PROMPTS[0]}, {"prompt_token_ids": ids[1]}, PROMPTS[2]], greedy())
    assert texts(mixed) == texts(plain)
    assert [o.prompt_token_ids for o in mixed] == ids
    assert [o.prompt for o in mixed] == [PROMPTS[0], None, PROMPTS[2]]   # token prompts have no text, as in vLLM
    assert texts(llm.generate([{"prompt_token_ids": ids[0]}, ids[1]], greedy())) == texts(plain)[:2]


def test_a_single_prompt_dict_is_one_prompt(llm):
    plain = llm.generate(PROMPTS[0], greedy())
    assert texts(llm.generate({"prompt": PROMPTS[0]}, greedy())) == texts(plain)
    ids = llm.tokenizer.encode(PROMPTS[0])
    assert texts(llm.generate({"prompt_token_ids": ids}, greedy())) == texts(plain)


@pytest.mark.parametrize("bad, message", [
    ({"prompt": "x", "multi_modal_data": {}}, r"prompts\[1\]: .*unknown key\(s\) \['multi_modal_data'\]"),
    ({"prompt": "x", "prompt_token_ids": [1]}, r"prompts\[1\]: .*exactly one of \['prompt', 'prompt_token_ids'\]"),
    ({}, r"prompts\[1\]: .*exactly one of"),
    ({"prompt_token_ids": []}, r"prompts\[1\]: \"prompt_token_ids\" must be a non-empty list"),
    ({"prompt_token_ids": [1, 10**9]}, r"prompts\[1\]: prompt token id 1000000000 is out of range"),
    ({"prompt_token_ids": [1, "a"]}, r"prompts\[1\] is invalid: expected a string, a list of token ids"),
    ({"prompt": 3}, r"prompts\[1\]: \"prompt\" must be a string"),
    (3.5, r"prompts\[1\] is invalid"),
])
def test_a_bad_prompt_is_refused_in_one_line_before_anything_runs(llm, bad, message):
    with pytest.raises(KestrelError, match=message) as err:
        llm.generate([PROMPTS[0], bad], greedy())
    assert "\n" not in str(err.value)
    assert not llm.engine.has_unfinished()   # the good prompt before it was not queued either


def test_del_llm_frees_the_engine_and_its_kv_cache(checkpoint):
    llm = LLM(model=str(checkpoint), device="cpu")
    llm.generate(PROMPTS[0], greedy())
    engine, kv = weakref.ref(llm.engine), weakref.ref(llm.engine.runner.kv_cache)
    del llm
    gc.collect()
    assert engine() is None and kv() is None


def test_shutdown_frees_memory_even_while_the_runner_is_still_referenced(checkpoint):
    llm = LLM(model=str(checkpoint), device="cpu")
    expected = texts(llm.generate(PROMPTS, greedy()))
    runner = llm.engine.runner   # a caller's reference must not keep the weights and the KV cache alive
    kv, weight = weakref.ref(runner.kv_cache), weakref.ref(next(runner.model.parameters()))
    llm.shutdown()
    assert kv() is None and weight() is None
    llm.shutdown()   # idempotent
    with pytest.raises(KestrelError, match="shut down"):
        llm.generate(PROMPTS[0], greedy())
    del runner
    second = LLM(model=str(checkpoint), device="cpu")   # the same process builds and serves another one
    assert texts(second.generate(PROMPTS, greedy())) == expected
