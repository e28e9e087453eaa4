"""The fused logits argmax (kestrel/kernels/triton/logits_argmax.py) on the GPU: the kernel equals `.float()` + torch.argmax at the
real vocabularies, inside a replayed CUDA graph (the counters must come back to zero every replay), and whole
engines give the same greedy tokens with it on and off."""
from __future__ import annotations

import pytest
import torch

from tests.gpu.engine_tokens import graph_head_keeps_tokens

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("vocab", [151_936, 128_256, 1000])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_kernel_in_a_graph_equals_torch_on_every_replay(vocab, rows):
    from kestrel.kernels.triton.logits_argmax import alloc_argmax_scratch, logits_argmax
    gen = torch.Generator(device="cuda").manual_seed(vocab + rows)
    logits = torch.zeros(rows, vocab, dtype=torch.bfloat16, device="cuda")
    tokens = torch.zeros(rows, dtype=torch.int64, device="cuda")
    scratch = alloc_argmax_scratch(16, torch.device("cuda"))
    logits_argmax(logits, tokens, scratch)   # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = logits_argmax(logits, tokens, scratch)
    for replay in range(4):
        logits.copy_(torch.randn(rows, vocab, generator=gen, device="cuda").to(torch.bfloat16))
        if replay == 3:   # a tie across chunks: the first index wins
            logits[:, [vocab - 1, 5]] = 100.0
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, logits.float())
        assert torch.equal(tokens, torch.argmax(logits.float(), dim=-1))
        assert torch.count_nonzero(scratch[2]) == 0


@pytest.mark.parametrize("arch", ["qwen3", None])   # a random checkpoint (bf16) and the default model
def test_engine_tokens_identical_with_and_without_the_fused_argmax(checkpoint_factory, monkeypatch, arch):
    assert graph_head_keeps_tokens(checkpoint_factory, arch)
