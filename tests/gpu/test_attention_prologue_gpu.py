"""Compiled qk_norm_rope_store agrees with its torch reference on CUDA at real model shapes, eagerly, under
CUDA-graph capture and replay, and inside the engine (on by default; the same tokens as an engine without it).

Same contract as tests/test_attention_prologue.py (the kernel in Triton's CPU interpreter); compiled casts round
like torch, so 16-bit results are also expected to be bit-equal to the reference almost everywhere.
"""
from __future__ import annotations

import pytest
import torch

from tests.test_attention_prologue import assert_close, prologue_inputs

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SHAPES = {  # name: (num_heads, num_kv_heads, head_dim, qk_norm)
    "qwen3-0.6b": (16, 8, 128, True),
    "llama-8b": (32, 8, 128, False),
    "gqa1-d64": (8, 8, 64, True),
}


def _rope_cache(head_dim: int, max_pos: int = 8192, base: float = 1_000_000.0) -> torch.Tensor:
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device="cuda").float() / head_dim))
    freqs = torch.outer(torch.arange(max_pos, device="cuda").float(), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def _cuda_inputs(tokens, shape, block_size, dtype, seed):
    num_heads, num_kv_heads, head_dim, qk_norm = SHAPES[shape]
    qkv, weights, positions, k_cache, v_cache, slots = prologue_inputs(
        tokens, num_heads, num_kv_heads, head_dim, block_size, dtype, qk_norm, seed)
    positions = torch.randint(0, 8192, (tokens,), generator=torch.Generator().manual_seed(seed))
    to_cuda = lambda t: None if t is None else t.cuda()   # noqa: E731
    # a row slice of a wider buffer, so the kernel must use qkv's row stride
    qkv = torch.empty(tokens, qkv.shape[1] + 64, dtype=dtype, device="cuda")[:, :qkv.shape[1]].copy_(qkv)
    return (qkv, [to_cuda(w) for w in weights], positions.cuda(), k_cache.cuda(), v_cache.cuda(), slots.cuda(),
            (num_heads, num_kv_heads, head_dim))


def _mostly_bit_equal(got: torch.Tensor, want: torch.Tensor, qk_norm: bool) -> None:
    # By default compiled Triton contracted each product and the sum after it into one FMA, where the reference
    # rounds each product to the model dtype (HF's rotate_half arithmetic): ~80% of 16-bit outputs were
    # bit-equal (sessions 5-13). The launch now turns contraction off (fused_ops.HF_ROUNDING; the PTX is checked
    # in tests/test_sm90_builds.py), so the rotary is HF's bit for bit except where a bf16 add rounds once and
    # torch's f32 add-then-cast twice (rare). The q/k norm's fp32 sum of squares still runs in another order
    # than torch's, so normed shapes keep the old bar. [Session 13: written after the device time was spent;
    # not yet run on the GPU.]
    if got.dtype != torch.float32:
        assert (got == want).float().mean().item() > (0.7 if qk_norm else 0.99)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("tokens,block_size", [(1, 16), (64, 16), (700, 16), (300, 2)])
def test_kernel_matches_reference(dtype, shape, tokens, block_size):
    from kestrel.kernels.triton.attention_prologue import qk_norm_rope_store, qk_norm_rope_store_ref
    qkv, (q_w, k_w), positions, k_cache, v_cache, slots, heads = _cuda_inputs(tokens, shape, block_size, dtype,
                                                                              seed=tokens)
    cache = _rope_cache(heads[2])
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want_q = qk_norm_rope_store_ref(qkv, q_w, k_w, 1e-6, positions, cache, want_k, want_v, slots, *heads)
    q = qk_norm_rope_store(qkv, q_w, k_w, 1e-6, positions, cache, k_cache, v_cache, slots, *heads)
    assert_close(q, want_q)
    assert_close(k_cache, want_k)
    assert torch.equal(v_cache, want_v)
    _mostly_bit_equal(q, want_q, SHAPES[shape][3])
    _mostly_bit_equal(k_cache, want_k, SHAPES[shape][3])


def test_kernel_captured_in_a_cuda_graph_replays_new_tokens_positions_and_slots():
    from kestrel.kernels.triton.attention_prologue import qk_norm_rope_store, qk_norm_rope_store_ref
    qkv, (q_w, k_w), positions, k_cache, v_cache, slots, heads = _cuda_inputs(8, "qwen3-0.6b", 16,
                                                                              torch.bfloat16, seed=1)
    cache = _rope_cache(heads[2])
    qk_norm_rope_store(qkv, q_w, k_w, 1e-6, positions, cache, k_cache, v_cache, slots, *heads)   # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q = qk_norm_rope_store(qkv, q_w, k_w, 1e-6, positions, cache, k_cache, v_cache, slots, *heads)
    for seed in (2, 3, 4):
        new_qkv, _, new_positions, _, _, new_slots, _ = _cuda_inputs(8, "qwen3-0.6b", 16, torch.bfloat16, seed)
        qkv.copy_(new_qkv)          # same tensors, new contents: what a graph replay sees
        positions.copy_(new_positions)
        slots.copy_(new_slots)
        want_k, want_v = k_cache.clone(), v_cache.clone()
        want_q = qk_norm_rope_store_ref(qkv, q_w, k_w, 1e-6, positions, cache, want_k, want_v, slots, *heads)
        graph.replay()
        assert_close(q, want_q)
        assert_close(k_cache, want_k)
        assert torch.equal(v_cache, want_v)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_engine_with_fused_prologue_gives_the_unfused_greedy_tokens(checkpoint_factory, monkeypatch, arch):
    """fp32 so the only difference is the sum order in the norm: greedy tokens must not move. Decode and
    prefill graphs on, so the prologue is also captured and replayed."""
    from kestrel import LLM, SamplingParams
    from kestrel.kernels.triton.attention_prologue import qk_norm_rope_store
    path = str(checkpoint_factory(arch))
    prompts = ["def add(a, b):\n    return a + b\n", "import os", "x = [i * i for i in range(10)]\nprint("]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    kw = dict(device="cuda", dtype="float32", attention_backend="triton", block_size=16)
    unfused = LLM(model=path, disable_cuda_graph=True, **kw)   # eager, so the prologue can be taken out
    for layer in unfused.engine.runner.model.layers:
        layer.self_attn.prologue = None
    plain = [o.outputs[0].token_ids for o in unfused.generate(prompts, params)]
    del unfused
    llm = LLM(model=path, **kw)   # the prologue is chosen on CUDA with the triton backend
    assert all(layer.self_attn.prologue is qk_norm_rope_store for layer in llm.engine.runner.model.layers)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == plain
