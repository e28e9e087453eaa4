"""The overlap schedule on CUDA with sampled rows: the device draw after each graph replay (written over the
argmax and fed to the next launch) gives the synchronous schedule's tokens for seeded requests."""
from __future__ import annotations

import pytest
import torch

from kestrel import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_seeded_sampling_with_overlap_matches_synchronous(checkpoint_factory):
    path = str(checkpoint_factory("qwen3"))
    prompts = ["def add(a, b):", "import os", "x = [i * i for i in range(10)]", "class Stack:"]
    params = [SamplingParams(max_tokens=32, temperature=0.8, seed=1, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=1.0, top_k=20, seed=2, ignore_eos=True),
              SamplingParams(max_tokens=32, temperature=0.7, top_p=0.9, min_p=0.05, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)]
    tokens = {}
    for overlap in (False, True):
        llm = LLM(model=path, device="cuda", dtype="float32", cuda_graph_max_bs=8, max_num_seqs=8,
                  disable_overlap_schedule=not overlap, gpu_memory_utilization=0.3)
        tokens[overlap] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        del llm
        torch.cuda.empty_cache()
    assert tokens[True] == tokens[False]
