"""Compiled decode_attention_from_qkv (attention prologue + decode in one launch, KESTREL_FUSED_DECODE_PROLOGUE=1)
against the two launches it replaces, at real model shapes, eagerly and under CUDA-graph replay, and whole engines
with the flag on and off (same greedy tokens).

Same contract as tests/test_fused_decode.py (the interpreter, where the two paths are bit-equal). Compiled, the
fused program reduces the q/k RMSNorm sums with decode's 4 warps where the prologue uses 1, so rstd may differ
in its last bit: k (and q) can be an ulp apart, hence close-and-mostly-bit-equal checks on the cache; v is a copy.
"""
from __future__ import annotations

import pytest
import torch

from tests.gpu.engine_tokens import routed_tokens_on_and_off
from tests.test_attention_prologue import assert_close
from tests.test_fused_decode import decode_inputs, one_launch, two_launches
from tests.test_triton_kernels import TOLERANCE

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SHAPES = {  # name: (num_heads, num_kv_heads, head_dim, qk_norm)
    "qwen3-0.6b": (16, 8, 128, True),
    "llama-8b": (32, 8, 128, False),
    "gqa1-d64": (8, 8, 64, True),
}
KV_LENS = [1, 300, 0, 2049, 17, 4096, 64, 65]   # a padded row, tile edges, contexts over many splits


def _rope_cache(head_dim: int, max_pos: int = 8192, base: float = 1_000_000.0) -> torch.Tensor:
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device="cuda").float() / head_dim))
    freqs = torch.outer(torch.arange(max_pos, device="cuda").float(), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def _cuda_inputs(kv_lens, shape, block_size, dtype, seed):
    num_heads, num_kv_heads, head_dim, qk_norm = SHAPES[shape]
    qkv, weights, *rest = decode_inputs(kv_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, qk_norm, seed)
    qkv = torch.empty(qkv.shape[0], qkv.shape[1] + 64, dtype=dtype, device="cuda")[:, :qkv.shape[1]].copy_(qkv)
    return (qkv, [None if w is None else w.cuda() for w in weights], *[t.cuda() for t in rest]), \
        (num_heads, num_kv_heads, head_dim)


def _check(got, want, caches, partials):
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(got.float(), want.float(), **TOLERANCE[want.dtype])
    assert_close(caches["one"][0], caches["two"][0])
    assert torch.equal(caches["one"][1], caches["two"][1])
    assert (caches["one"][0] == caches["two"][0]).float().mean().item() > 0.99
    assert torch.count_nonzero(partials[2]) == 0


@pytest.mark.parametrize("merge", ["atomic", "reduce"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_kernel_matches_the_two_launches(shape, dtype, merge, monkeypatch):
    monkeypatch.setenv("KESTREL_DECODE_MERGE", merge)
    from kestrel.attention.triton_kernels import alloc_decode_partials
    (qkv, (q_w, k_w), positions, k_cache, v_cache, slots, table, lens), heads = _cuda_inputs(
        KV_LENS, shape, 16, dtype, seed=len(shape))
    cache = _rope_cache(heads[2])
    caches = {path: (k_cache.clone(), v_cache.clone()) for path in ("two", "one")}
    partials = alloc_decode_partials(len(KV_LENS), *heads, qkv.device)
    want = two_launches(qkv, q_w, k_w, positions, cache, *caches["two"], slots, table, lens, heads, None)
    got = one_launch(qkv, q_w, k_w, positions, cache, *caches["one"], slots, table, lens, heads, None, partials)
    _check(got, want, caches, partials)
    assert torch.equal(got[2], torch.zeros_like(got[2]))


def test_kernel_captured_in_a_cuda_graph_replays_new_lengths_tokens_and_slots():
    from kestrel.attention.triton_kernels import alloc_decode_partials
    (qkv, (q_w, k_w), positions, k_cache, v_cache, slots, table, lens), heads = _cuda_inputs(
        KV_LENS, "qwen3-0.6b", 16, torch.bfloat16, seed=1)
    cache = _rope_cache(heads[2])
    partials = alloc_decode_partials(len(KV_LENS), *heads, qkv.device)
    args = lambda: (qkv, q_w, k_w, positions, cache, k_cache, v_cache, slots, table, lens, heads, None,   # noqa: E731
                    partials)
    one_launch(*args())   # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = one_launch(*args())
    # permutations of KV_LENS: the same cache and table shapes, so new contents can be copied into the captured ones
    for seed, kv_lens in ((2, [4096, 1, 65, 300, 2049, 17, 0, 64]), (3, KV_LENS[::-1])):
        (new_qkv, _, new_pos, new_k, new_v, new_slots, new_table, new_lens), _ = _cuda_inputs(
            kv_lens, "qwen3-0.6b", 16, torch.bfloat16, seed)
        for dst, src in ((qkv, new_qkv), (positions, new_pos), (k_cache, new_k), (v_cache, new_v),
                         (slots, new_slots), (table, new_table), (lens, new_lens)):
            dst.copy_(src)
        caches = {"two": (k_cache.clone(), v_cache.clone()), "one": (k_cache, v_cache)}
        want = two_launches(qkv, q_w, k_w, positions, cache, *caches["two"], slots, table, lens, heads, None)
        graph.replay()
        torch.cuda.synchronize()
        _check(out, want, caches, partials)
    # every row padded: outputs 0, caches untouched
    lens.zero_()
    slots.fill_(-1)
    before = k_cache.clone(), v_cache.clone()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.count_nonzero(out) == 0 and torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_engine_tokens_identical_with_the_flag_on_and_off(checkpoint_factory, monkeypatch, arch):
    """fp32 random checkpoints with decode graphs: the one-launch path must not move a greedy token."""
    from kestrel.attention import fused_decode
    path = str(checkpoint_factory(arch))
    on, off = routed_tokens_on_and_off(path, monkeypatch, fused_decode, "decode_attention_from_qkv",
                                       "KESTREL_FUSED_DECODE_PROLOGUE", "1", "0", dtype="float32",
                                       attention_backend="triton")
    assert on == off
