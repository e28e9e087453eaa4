"""Two LLMs one after the other in one process, each sized to 60% of the GPU: the second fits only if `del llm`
gave back everything the first held (weights, KV cache, CUDA graphs and their pool)."""
from __future__ import annotations

import gc

import pytest
import torch

from kestrel import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = ["def add(a, b):", "import os", "class Stack:"]
# Enough sequences that the KV cache is bounded by gpu_memory_utilization, not by what max_num_seqs could use
# (the default model's 2048 tokens take 2 * 8192 * 128 blocks of 64 KiB, past 60% of an H200): the first LLM
# really holds 60% of the card, and a leak leaves the second no room for its cache.
ENGINE = dict(device="cuda", gpu_memory_utilization=0.6, max_num_seqs=8192)


def greedy_texts(llm: LLM) -> list[str]:
    return [o.outputs[0].text for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16))]


def test_a_second_llm_fits_after_del_and_memory_returns_to_the_start():
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    total = torch.cuda.get_device_properties(0).total_memory

    first = LLM(**ENGINE)
    assert torch.cuda.memory_allocated() - start > 0.45 * total   # the cache took most of the 60%
    expected = greedy_texts(first)
    del first
    gc.collect()
    torch.cuda.empty_cache()
    assert torch.cuda.memory_allocated() - start < 256 << 20   # near the start: no weights, cache or graphs left

    second = LLM(**ENGINE)
    assert greedy_texts(second) == expected
    second.shutdown()
    assert torch.cuda.memory_allocated() - start < 256 << 20   # shutdown() alone, no gc by the caller
