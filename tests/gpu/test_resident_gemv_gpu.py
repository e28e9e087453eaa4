"""The resident matmul (layers/resident_gemv.py) agrees with gemv.py's torch reference on fresh random inputs:
the Llama-3.1-8B's o_proj shape, shapes whose last block owns fewer rows, every staged/streamed split (including
none streamed), with and without bias, replayed in a CUDA graph right behind the cluster decode kernel (the
place it runs, with that kernel's shared-memory carveout), and in a whole engine against the plain path."""
from __future__ import annotations

import pytest
import torch

from kestrel.layers import gemv, resident_gemv
from kestrel.layers.pdl import sm_count
from tests.gpu.engine_tokens import routed_tokens_on_and_off
from tests.gpu.test_gemv_gpu import cuda_inputs, mostly_bit_equal

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("n,k", [(4096, 4096), (4000, 4096), (100, 1024), (1024, 4096)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_reference(n, k, with_bias):
    t = cuda_inputs(1, k, n, torch.bfloat16, seed=n + k + with_bias, with_bias=with_bias)
    assert resident_gemv.usable(t["x"], t["w"])
    mostly_bit_equal(resident_gemv.gemv(t["x"], t["w"], t["bias"]), gemv.gemv_ref(t["x"], t["w"], t["bias"]))


@pytest.mark.parametrize("budget_kb,prefetch", [(188, True), (188, False), (160, True), (227, True)])
def test_every_split_of_staged_and_streamed(budget_kb, prefetch):
    n, k = 4096, 4096
    config = resident_gemv.config_for(n, k, sm_count(0), budget_kb * 1024, prefetch)
    if config is None:
        pytest.skip("the streamed part would not fit")
    print(config, "streamed", k - config.smem_k)
    t = cuda_inputs(1, k, n, torch.bfloat16, seed=budget_kb, with_bias=True)
    mostly_bit_equal(resident_gemv.gemv(t["x"], t["w"], t["bias"], config=config),
                     gemv.gemv_ref(t["x"], t["w"], t["bias"]))


def test_not_usable_off_its_contract():
    x = torch.zeros(1, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.zeros(4096, 4096, device="cuda", dtype=torch.bfloat16)
    assert resident_gemv.usable(x, w)
    assert not resident_gemv.usable(torch.zeros(2, 4096, device="cuda", dtype=torch.bfloat16), w)   # one row
    assert not resident_gemv.usable(x.float(), w.float())
    assert not resident_gemv.usable(x[:, :4000], w[:, :4000])                                      # K % 256


def test_replayed_in_a_graph_behind_cluster_decode(monkeypatch):
    """decode attention -> resident o_proj, captured once, replayed with new K/V, q and lengths."""
    monkeypatch.setenv("KESTREL_RESIDENT_GEMV", "1")
    from kestrel.attention import cluster_decode
    from tests.gpu.test_cluster_decode_gpu import _reference

    heads, kv_heads, dim, block, blocks = 32, 8, 128, 16, 64
    gen = torch.Generator(device="cuda").manual_seed(7)
    k_cache = torch.randn(blocks, block, kv_heads, dim, device="cuda", generator=gen).to(torch.bfloat16)
    v_cache = torch.randn_like(k_cache.float()).to(torch.bfloat16)
    q = torch.randn(1, heads, dim, device="cuda", generator=gen).to(torch.bfloat16)
    table = torch.randperm(blocks, device="cuda").view(1, -1).to(torch.int64)
    lens = torch.tensor([300], device="cuda", dtype=torch.int64)
    w = (torch.randn(heads * dim, heads * dim, device="cuda", generator=gen) / 64).to(torch.bfloat16)
    assert cluster_decode.usable(q, k_cache, v_cache, 1)

    def step():
        attn = cluster_decode.decode_attention(q, k_cache, v_cache, table, lens, dim ** -0.5)
        return attn, resident_gemv.gemv(attn.view(1, -1), w)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attn, out = step()
    for length in (300, 1000, 17):
        q.copy_(torch.randn(q.shape, device="cuda", generator=gen).to(torch.bfloat16))
        k_cache.copy_(torch.randn(k_cache.shape, device="cuda", generator=gen).to(torch.bfloat16))
        lens.fill_(length)
        graph.replay()
        want_attn = _reference(q, k_cache, v_cache, table, lens)
        torch.testing.assert_close(attn.float(), want_attn.float(), atol=2e-2, rtol=2e-2)
        mostly_bit_equal(out, gemv.gemv_ref(attn.view(1, -1), w))


def test_engine_with_the_resident_o_proj_on_and_off(checkpoint_factory, monkeypatch):
    """A bf16 engine whose o_proj runs here (KESTREL_RESIDENT_GEMV=1 with the CUDA matmuls on every weight)
    against the same engine without it: greedy tokens (bf16 near-ties aside)."""
    path = str(checkpoint_factory("llama", hidden_size=256, intermediate_size=512, head_dim=64))
    monkeypatch.setenv("KESTREL_CUDA_GEMV", "all")
    on, off = routed_tokens_on_and_off(path, monkeypatch, resident_gemv, "gemv",
                                       "KESTREL_RESIDENT_GEMV", "1", "0", dtype="bfloat16")
    same = sum(a == b for x, y in zip(on, off) for a, b in zip(x, y)) / sum(len(x) for x in off)
    print(f"resident o_proj: {same:.1%} of greedy tokens identical")
    assert all(x[:2] == y[:2] for x, y in zip(on, off)) and same > 0.5
