"""The decode graph's fused head (kestrel/kernels/triton/step_inputs.py) on the GPU: the graph head's kernel equals the torch ops it
replaces at the real sizes (8,192-column tables, Llama-3.1-8B's hidden size, 128 rows, 256 updates) inside a
replayed CUDA graph, where its CTA barrier (a row's new entries, then the row's copy) is what keeps it right;
and whole engines give the same greedy tokens with it on and off."""
from __future__ import annotations

import random

import pytest
import torch

from kestrel.forward.decode_graphs import packed_layout, torch_step_inputs
from tests.gpu.engine_tokens import graph_head_keeps_tokens
from tests.test_step_inputs import _random_step

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("q", [1, 4])
@pytest.mark.parametrize("bucket", [1, 8, 128])
def test_kernel_in_a_graph_equals_the_torch_ops_on_every_replay(q, bucket):
    from kestrel.kernels.triton.step_inputs import step_inputs
    rng = random.Random(bucket * 10 + q)
    max_bs, max_rows, width, block_size, vocab, hidden = 128, 256, 8192, 16, 128_256, 4096
    max_table_writes = 2 * max_bs
    layout, size = packed_layout(max_bs, q, max_table_writes)
    packed = torch.zeros(size, dtype=torch.int64, device="cuda")
    embed = torch.randn(vocab, hidden, device="cuda").to(torch.bfloat16)
    tables = torch.randint(0, 50_000, (max_rows + 1, width), dtype=torch.int64, device="cuda")
    tables_ref = tables.clone()
    block_table = torch.zeros(max_bs, width, dtype=torch.int64, device="cuda")
    args = (layout, tables, embed, block_table, bucket, q, max_table_writes, block_size)
    step_inputs(packed, *args)   # compile outside the capture (an all-zero step: row 0 gets block 0 at column 0)
    torch_step_inputs(packed, layout, tables_ref, embed, None, bucket, q, max_table_writes, block_size)
    assert torch.equal(tables[:max_rows], tables_ref[:max_rows])   # see _random_step: the dummy row
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step_inputs(packed, *args)
    for _ in range(4):
        bs = rng.randint(1, bucket)
        step = _random_step(rng, max_bs, bs, q, max_rows, 64, block_size, vocab, max_table_writes)   # up to 1,024 keys
        packed.copy_(step.cuda())
        before = block_table.clone()
        graph.replay()
        want = torch_step_inputs(packed, layout, tables_ref, embed, None, bucket, q, max_table_writes, block_size)
        torch.cuda.synchronize()
        assert torch.equal(tables[:max_rows], tables_ref[:max_rows])   # see _random_step: the dummy row
        assert torch.equal(out[1], want[1]) and torch.equal(out[2], want[2])
        kv_lens = step[layout["kv_lens"][0]:layout["kv_lens"][0] + bucket].tolist()
        for i, kv_len in enumerate(kv_lens):
            n = -(-kv_len // block_size)
            assert torch.equal(out[0][i, :n], want[0][i, :n]), f"row {i}"
            assert torch.equal(out[0][i, n:], before[i, n:])


@pytest.mark.parametrize("arch", ["llama", None])   # a random checkpoint (bf16) and the default model
def test_engine_tokens_identical_with_and_without_the_fused_head(checkpoint_factory, monkeypatch, arch):
    assert graph_head_keeps_tokens(checkpoint_factory, arch)
