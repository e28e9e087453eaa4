"""--kv-cache-dtype fp8 on CUDA: the compiled kernels write the reference's e4m3 bytes and read them as the torch
reference does (realistic shapes, bf16 queries), and the engine (triton backend, CUDA graphs) keeps the CPU tests'
stated bounds (tests/test_kv_cache_fp8.py) against a bf16 cache, with graph replays giving the eager tokens."""
from __future__ import annotations

import pytest
import torch

from tests.test_kv_cache_fp8 import LOGITS_BOUND, PROMPTS, long_prompts, worst_relative_error
from tests.test_triton_kernels import TOLERANCE, start_locs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
FP8 = torch.float8_e4m3fn
K_SCALE, V_SCALE = 0.75, 1.5


def fp8_cache(kv_lens: list[int], num_kv_heads: int, head_dim: int, block_size: int, seed: int):
    from kestrel.kernels.kv_store import quantize

    gen = torch.Generator().manual_seed(seed)
    needed = [-(-n // block_size) for n in kv_lens]
    shape = (sum(needed) + 3, block_size, num_kv_heads, head_dim)
    k = quantize(2 * torch.randn(shape, generator=gen), torch.empty(0, dtype=FP8), K_SCALE)
    v = quantize(2 * torch.randn(shape, generator=gen), torch.empty(0, dtype=FP8), V_SCALE)
    order = torch.randperm(shape[0], generator=gen).tolist()
    table = torch.full((len(kv_lens), max(needed) + 1), -1, dtype=torch.int32)
    for s, n in enumerate(needed):
        table[s, :n] = torch.tensor(order[:n], dtype=torch.int32)
        order = order[n:]
    return k.cuda(), v.cuda(), table.cuda()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_store_kv_writes_the_reference_bytes(dtype):
    from kestrel.kernels import kv_store
    from kestrel.kernels.triton import paged_attention

    gen = torch.Generator().manual_seed(0)
    k = (4 * torch.randn(300, 8, 128, generator=gen)).to(dtype).cuda()
    v = (4 * torch.randn(300, 8, 128, generator=gen)).to(dtype).cuda()
    k[0, 0, :2] = torch.tensor([1000.0, -1000.0], dtype=dtype)   # clamped to +-448
    slots = torch.randperm(40 * 16, generator=gen)[:300].cuda()
    slots[::7] = -1
    caches = [torch.zeros(40, 16, 8, 128, dtype=FP8, device="cuda") for _ in range(4)]
    kv_store.store_kv(k, v, caches[0], caches[1], slots, K_SCALE, V_SCALE)
    paged_attention.store_kv(k, v, caches[2], caches[3], slots, K_SCALE, V_SCALE)
    assert torch.equal(caches[2].view(torch.uint8), caches[0].view(torch.uint8))
    assert torch.equal(caches[3].view(torch.uint8), caches[1].view(torch.uint8))


@pytest.mark.parametrize("group,head_dim", [(4, 128), (8, 64)])
def test_extend_and_decode_over_an_fp8_cache_match_the_reference(group, head_dim):
    from kestrel.attention import torch_ref
    from kestrel.kernels.triton import paged_attention, paged_decode

    query_lens, kv_lens = [1000, 512, 5, 1, 77], [1000, 2560, 1205, 300, 77]
    k_cache, v_cache, table = fp8_cache(kv_lens, 8, head_dim, 16, seed=group)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(sum(query_lens), 8 * group, head_dim, generator=gen).to(torch.bfloat16).cuda()
    qsl, lens = start_locs(query_lens).cuda(), torch.tensor(kv_lens, dtype=torch.int32, device="cuda")
    out = paged_attention.extend_attention(q, k_cache, v_cache, table, qsl, lens, max(query_lens),
                                           head_dim ** -0.5, None, K_SCALE, V_SCALE)
    ref = torch_ref.paged_attention(q, k_cache, v_cache, table, qsl, lens, max(query_lens), max(kv_lens),
                                    head_dim ** -0.5, None, K_SCALE, V_SCALE)
    torch.testing.assert_close(out.float(), ref.float(), **TOLERANCE[torch.bfloat16])
    q1 = q[:len(kv_lens)].contiguous()
    out = paged_decode.decode_attention(q1, k_cache, v_cache, table, lens, head_dim ** -0.5,
                                        k_scale=K_SCALE, v_scale=V_SCALE)
    ref = torch_ref.paged_attention(q1, k_cache, v_cache, table, start_locs([1] * len(kv_lens)).cuda(), lens, 1,
                                    max(kv_lens), head_dim ** -0.5, k_scale=K_SCALE, v_scale=V_SCALE)
    torch.testing.assert_close(out.float(), ref.float(), **TOLERANCE[torch.bfloat16])


def test_prologue_writes_the_reference_bytes():
    from kestrel.kernels.triton.attention_prologue import qk_norm_rope_store, qk_norm_rope_store_ref
    from tests.test_attention_prologue import cos_sin_cache, prologue_inputs

    qkv, (q_w, k_w), positions, k_cache, v_cache, slots = prologue_inputs(
        33, 32, 8, 128, 16, torch.bfloat16, True, seed=3)
    qkv, positions, slots = qkv.cuda(), positions.cuda(), slots.cuda()
    q_w, k_w = q_w.cuda(), k_w.cuda()
    caches = [torch.zeros(k_cache.shape, dtype=FP8, device="cuda") for _ in range(4)]
    cache = cos_sin_cache(128).cuda()
    qk_norm_rope_store_ref(qkv, q_w, k_w, 1e-6, positions, cache, caches[0], caches[1], slots, 32, 8, 128,
                           k_scale=K_SCALE, v_scale=V_SCALE)
    qk_norm_rope_store(qkv, q_w, k_w, 1e-6, positions, cache, caches[2], caches[3], slots, 32, 8, 128,
                       k_scale=K_SCALE, v_scale=V_SCALE)
    assert torch.equal(caches[3].view(torch.uint8), caches[1].view(torch.uint8))   # v: scaled and rounded only
    # k is normed and rotated first: a last-bit difference there may move a value to its e4m3 neighbour
    differ = caches[2].view(torch.uint8) != caches[0].view(torch.uint8)
    assert differ.float().mean() < 0.01
    torch.testing.assert_close(caches[2].float(), caches[0].float(), atol=2 ** -9, rtol=0.125)


def test_engine_on_cuda_keeps_the_bounds_and_graphs_replay_the_eager_tokens():
    from kestrel import LLM
    from kestrel.sampling_params import SamplingParams

    budget = 256 << 20
    ref = LLM(dtype="bfloat16", kv_cache_memory=budget)
    fp8 = LLM(dtype="bfloat16", kv_cache_memory=budget, kv_cache_dtype="fp8")
    eager = LLM(dtype="bfloat16", kv_cache_memory=budget, kv_cache_dtype="fp8", disable_cuda_graph=True)
    try:
        assert fp8.engine.runner.kv_cache.dtype == FP8 and fp8.engine.runner.graphs is not None
        assert fp8.engine.pool.num_blocks == 2 * ref.engine.pool.num_blocks
        worst = worst_relative_error(fp8, ref, long_prompts(ref.tokenizer))
        params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
        graphs, plain = fp8.generate(PROMPTS, params), eager.generate(PROMPTS, params)
    finally:
        for llm in (ref, fp8, eager):
            llm.shutdown()
    # bf16 weights and activations on both sides: the FP8 cache's share of the error is what the bound covers
    assert worst <= LOGITS_BOUND, f"worst per-position relative logits error {worst:.3f}"
    assert [o.outputs[0].token_ids for o in graphs] == [o.outputs[0].token_ids for o in plain]
