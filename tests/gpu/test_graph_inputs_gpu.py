"""KESTREL_FUSED_GRAPH_INPUTS (engine/graph_inputs.py) on the GPU: the kernel equals the torch ops it replaces,
replayed inside a CUDA graph over packed buffers refilled between replays, and engine tokens are identical with
the switch on and off (the kernel moves integers: nothing may change)."""
from __future__ import annotations

import pytest
import torch

from tests.gpu.engine_tokens import switch_keeps_tokens
from tests.test_graph_inputs import packed_step, views_of

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("width,bs,q,max_updates", [(2560, 8, 1, 512), (300, 6, 3, 16)])
def test_kernel_in_a_replayed_graph_matches_torch(width, bs, q, max_updates):
    from kestrel.engine.cuda_graphs import graph_inputs_torch
    from kestrel.engine.graph_inputs import graph_inputs
    gen = torch.Generator().manual_seed(width)
    tables, dev, spans = packed_step(gen, num_rows=40, width=width, bs=bs, q=q, max_updates=max_updates)
    tables, static_dev = tables.cuda(), dev.cuda()
    dviews = views_of(static_dev, spans)
    ref_tables = tables.clone()
    graph_inputs(tables, static_dev, *dviews)   # compile outside the capture
    tables.copy_(ref_tables)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        block_table, input_ids = graph_inputs(tables, static_dev, *dviews)
    for step in range(3):   # new packed inputs each replay, as the engine copies them in
        _, step_dev, _ = packed_step(torch.Generator().manual_seed(width + step), num_rows=40, width=width, bs=bs,
                                     q=q, max_updates=max_updates)
        static_dev.copy_(step_dev.cuda())
        graph.replay()
        ref_block_table, ref_ids = graph_inputs_torch(ref_tables, static_dev, *dviews)
        torch.cuda.synchronize()
        assert torch.equal(block_table, ref_block_table)
        assert torch.equal(input_ids, ref_ids)
        assert torch.equal(tables, ref_tables)


@pytest.mark.parametrize("arch", ["qwen3", None])
def test_engine_tokens_identical_with_and_without_fused_graph_inputs(checkpoint_factory, monkeypatch, arch):
    assert switch_keeps_tokens(checkpoint_factory, monkeypatch, arch, "KESTREL_FUSED_GRAPH_INPUTS")
