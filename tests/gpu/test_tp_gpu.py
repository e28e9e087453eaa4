"""Tensor parallelism on two GPUs (NCCL, CUDA graphs with the all-reduces and the logits all-gather captured):
float32 greedy tokens equal one GPU's, on the decode graphs, the prefill graphs and the overlap schedule, and
seeded sampled rows of the overlap schedule (whose tokens rank 0 broadcasts) equal the synchronous schedule's."""
from __future__ import annotations

import pytest
import torch

from kestrel import LLM, SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]

PROMPTS = ["def add(a, b):", "import os", "x = [i * i for i in range(10)]", "class Stack:"]


def generate(path: str, tp: int, params, **kw) -> list[list[int]]:
    llm = LLM(model=path, device="cuda", dtype="float32", tensor_parallel_size=tp, cuda_graph_max_bs=8,
              max_num_seqs=8, gpu_memory_utilization=0.3, **kw)
    try:
        if tp > 1:
            assert llm.engine.runner.graphs is not None, "decode graphs were not captured on every rank"
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    finally:
        llm.shutdown()
        torch.cuda.empty_cache()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tp2_greedy_tokens_equal_one_gpu_through_the_graphs(checkpoint_factory, arch):
    path = str(checkpoint_factory(arch))
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    assert generate(path, 2, greedy) == generate(path, 1, greedy)


def test_tp2_sampled_rows_of_the_overlap_schedule_equal_the_synchronous_schedule(checkpoint_factory):
    path = str(checkpoint_factory("llama"))
    params = [SamplingParams(max_tokens=24, temperature=0.8, seed=i, ignore_eos=True) for i in range(len(PROMPTS))]
    assert generate(path, 2, params) == generate(path, 2, params, disable_overlap_schedule=True)


def test_tp2_custom_all_reduce_opens_and_gives_nccls_tokens(checkpoint_factory):
    """Small all-reduces go through symmetric memory (one-shot, in the graphs); with two ranks a + b is exact in
    either order, so the tokens equal NCCL's."""
    path = str(checkpoint_factory("llama"))
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    llm = LLM(model=path, device="cuda", dtype="bfloat16", tensor_parallel_size=2, cuda_graph_max_bs=8,
              max_num_seqs=8, gpu_memory_utilization=0.3)
    try:
        assert llm.engine.runner.tp.fast_all_reduce is not None, "symmetric-memory all-reduce did not open"
        fast = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy)]
    finally:
        llm.shutdown()
        torch.cuda.empty_cache()
    llm = LLM(model=path, device="cuda", dtype="bfloat16", tensor_parallel_size=2, cuda_graph_max_bs=8,
              max_num_seqs=8, gpu_memory_utilization=0.3, disable_custom_all_reduce=True)
    try:
        assert llm.engine.runner.tp.fast_all_reduce is None
        nccl = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy)]
    finally:
        llm.shutdown()
        torch.cuda.empty_cache()
    assert fast == nccl
