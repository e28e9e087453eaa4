"""Triton kernels (attention + fused ops) agree with their torch references, run on CPU by Triton's interpreter.

Triton decides at `import triton` whether kernels are compiled or interpreted, and in a full test run something
(transformers, torch._dynamo) has imported it long before this module. So in a normal process this module runs
one test, which starts a child pytest on this file with TRITON_INTERPRET=1; in that child the kernel tests run.
Known interpreter gaps the kernels work around (see paged_attention.py): bf16 tl.dot is wrong, so interpreted
kernels upcast bf16 to fp32 before dots; fp32->bf16 casts truncate instead of rounding, so bf16 comparisons
allow a couple of bf16 ulps; tensor loop bounds fail with numpy >= 2.4, so interpreted kernels use while loops.
"""
from __future__ import annotations


import pytest
import torch

from tests.tolerances import scaled
from tests.triton_interpreter import INTERPRETED, run_file_under_interpreter
from tests.triton_interpreter import interpreted_only as interpreted_only_marker

interpreted_only = interpreted_only_marker("test_kernels_under_triton_interpreter")


@pytest.mark.slow   # a child pytest running the file's kernels in Triton's interpreter
@pytest.mark.skipif(INTERPRETED, reason="this is the interpreter child")
def test_kernels_under_triton_interpreter():
    run_file_under_interpreter(__file__, min_passed=52)   # all but the ones that skip in the child


# ------------------------------------------------------------------------------------------------ helpers

# Chosen for values of order one; comparisons pass them through tests.tolerances.scaled, which grows the absolute
# part with the reference's largest magnitude (a reordered sum's error grows with it).
TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
             torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def random_paged_cache(kv_lens: list[int], num_kv_heads: int, head_dim: int, block_size: int,
                       dtype: torch.dtype, gen: torch.Generator):
    """Caches full of noise and a block table handing each sequence shuffled, non-contiguous blocks."""
    needed = [-(-n // block_size) for n in kv_lens]
    num_blocks = sum(needed) + 3     # spare blocks hold junk that must never be read
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.full((len(kv_lens), max(needed) + 1), -1, dtype=torch.int32)   # one spare column of -1
    for s, n in enumerate(needed):
        table[s, :n] = torch.tensor(order[:n], dtype=torch.int32)
        order = order[n:]
    return k_cache, v_cache, table


def start_locs(query_lens: list[int]) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32)


ATTN_CASES = [  # (num_kv_heads, group, head_dim, block_size, dtype)
    (2, 1, 64, 2, torch.float32),
    (1, 4, 128, 16, torch.float32),
    (1, 8, 64, 16, torch.bfloat16),
    (2, 4, 64, 2, torch.float16),
]


# ------------------------------------------------------------------------------------------------ store_kv

@interpreted_only
@pytest.mark.parametrize("block_size", [2, 16])
def test_store_kv_writes_each_token_at_its_slot_and_skips_minus_one(block_size):
    from kestrel.attention import torch_ref
    from kestrel.kernels.triton import paged_attention
    gen = torch.Generator().manual_seed(block_size)
    k_cache, v_cache, _ = random_paged_cache([40], 2, 64, block_size, torch.float32, gen)
    k = torch.randn(7, 2, 64, generator=gen)
    v = torch.randn(7, 2, 64, generator=gen)
    slots = torch.tensor([3, -1, 0, 17, -1, 5, 30], dtype=torch.int64)
    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    torch_ref.store_kv(k, v, expect_k, expect_v, slots)
    paged_attention.store_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expect_k) and torch.equal(v_cache, expect_v)


def test_unpadded_store_kv_equals_the_filtering_one():
    """The capturable reference write (index_copy_, used to time the torch references inside CUDA graphs) puts
    every token where the boolean-indexing one does."""
    from kestrel.attention import torch_ref
    gen = torch.Generator().manual_seed(5)
    k_cache, v_cache, _ = random_paged_cache([40], 2, 64, 4, torch.bfloat16, gen)
    k, v = torch.randn(5, 2, 64, generator=gen), torch.randn(5, 2, 64, generator=gen)
    slots = torch.tensor([3, 0, 17, 5, 30], dtype=torch.int32)
    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    torch_ref.store_kv(k, v, expect_k, expect_v, slots)
    torch_ref.store_kv_unpadded(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expect_k) and torch.equal(v_cache, expect_v)


# ------------------------------------------------------------------------------------------------ decode

@interpreted_only
@pytest.mark.parametrize("num_kv_heads,group,head_dim,block_size,dtype", ATTN_CASES)
@pytest.mark.parametrize("num_splits", [1, 3, None])
def test_decode_matches_reference_on_ragged_contexts(num_kv_heads, group, head_dim, block_size, dtype, num_splits):
    from kestrel.attention import torch_ref
    from kestrel.kernels.triton import paged_decode
    gen = torch.Generator().manual_seed(head_dim * block_size + group)
    kv_lens = [1, 17, 75]    # 75 tokens span several 16-token tiles and every one of 3 splits
    k_cache, v_cache, table = random_paged_cache(kv_lens, num_kv_heads, head_dim, block_size, dtype, gen)
    q = torch.randn(3, num_kv_heads * group, head_dim, generator=gen).to(dtype)
    lens = torch.tensor(kv_lens, dtype=torch.int32)
    out = paged_decode.decode_attention(q, k_cache, v_cache, table, lens, head_dim ** -0.5, num_splits)
    ref = torch_ref.paged_attention(q, k_cache, v_cache, table, start_locs([1, 1, 1]), lens, 1, max(kv_lens),
                                    head_dim ** -0.5)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref.float(), **scaled(TOLERANCE[dtype], ref.float()))


@interpreted_only
def test_decode_reuses_static_buffers_as_lengths_change_like_a_graph_replay():
    from kestrel.attention import torch_ref
    from kestrel.kernels.triton import paged_decode
    gen = torch.Generator().manual_seed(1)
    k_cache, v_cache, table = random_paged_cache([70, 70], 2, 64, 4, torch.float32, gen)
    q = torch.randn(2, 8, 64, generator=gen)
    partials = paged_decode.alloc_decode_partials(4, 8, 2, 64, q.device)   # sized for a larger max batch
    lens = torch.zeros(2, dtype=torch.int32)
    for new_lens in ([70, 3], [16, 64], [1, 33]):
        lens.copy_(torch.tensor(new_lens))         # same tensors, same shapes, new contents
        out = paged_decode.decode_attention(q, k_cache, v_cache, table, lens, 0.125, 4, partials)
        ref = torch_ref.paged_attention(q, k_cache, v_cache, table, start_locs([1, 1]), lens, 1, 70, 0.125)
        torch.testing.assert_close(out, ref, **scaled(TOLERANCE[torch.float32], ref))


@interpreted_only
@pytest.mark.parametrize("group,dtype", [(1, torch.float32), (4, torch.float16), (8, torch.bfloat16)])
def test_decode_merges_splits_in_one_launch_and_leaves_the_counters_at_zero(group, dtype):
    from kestrel.attention import torch_ref
    from kestrel.kernels.triton import paged_decode
    gen = torch.Generator().manual_seed(8 + group)
    num_kv_heads, head_dim = 2, 64
    k_cache, v_cache, table = random_paged_cache([100] * 5, num_kv_heads, head_dim, 4, dtype, gen)
    q = torch.zeros(5, num_kv_heads * group, head_dim, dtype=dtype)
    lens = torch.zeros(5, dtype=torch.int32)
    partials = paged_decode.alloc_decode_partials(8, num_kv_heads * group, num_kv_heads, head_dim, q.device)
    # With 4 splits and the interpreter's 16-token tiles, a context of n tokens uses cdiv(n, per_split) splits:
    # 0 -> none (padded row), 1..16 -> 1, 17 -> 2, 33 / 40 / 65 -> 3, 64 / 100 -> 4 (all).
    for new_lens in ([100, 0, 16, 40, 1], [0, 65, 17, 0, 33], [64, 100, 0, 9, 40], [0, 0, 0, 0, 0]):
        lens.copy_(torch.tensor(new_lens))         # same tensors and scratch every call, like a graph replay
        q.copy_(torch.randn(q.shape, generator=gen).to(dtype))
        out = paged_decode.decode_attention(q, k_cache, v_cache, table, lens, head_dim ** -0.5, 4, partials)
        ref = torch_ref.paged_attention(q, k_cache, v_cache, table, start_locs([1] * 5), lens, 1, 100,
                                        head_dim ** -0.5)
        torch.testing.assert_close(out.float(), ref.float(), **scaled(TOLERANCE[dtype], ref.float()))
        for row, n in enumerate(new_lens):
            if n == 0:
                assert torch.equal(out[row], torch.zeros_like(out[row]))
        assert torch.count_nonzero(partials[2]) == 0, f"counters left at {partials[2].tolist()}"


@interpreted_only
@pytest.mark.parametrize("kv_len", [1, 16, 17, 40])
def test_prefetched_decode_reads_the_newest_token_after_the_wait(kv_len):
    """The first tile is read before the PDL wait without the newest token's row (on the GPU the kernel before
    decode is still writing it) and that row is read after the wait and put back; here it dominates the scores
    and values, so an answer without it, or with it twice, differs from the reference."""
    from kestrel.attention import torch_ref
    from kestrel.kernels.triton import paged_decode
    gen = torch.Generator().manual_seed(kv_len)
    k_cache, v_cache, table = random_paged_cache([kv_len], 2, 64, 4, torch.float32, gen)
    q = torch.randn(1, 4, 64, generator=gen)
    lens = torch.tensor([kv_len], dtype=torch.int32)
    block, offset = table[0, (kv_len - 1) // 4].item(), (kv_len - 1) % 4
    k_cache[block, offset] = 3 * torch.randn(2, 64, generator=gen)   # the newest token stands out in the scores
    v_cache[block, offset] = 10.0
    out = paged_decode.decode_attention(q, k_cache, v_cache, table, lens, 0.125, 3)
    ref = torch_ref.paged_attention(q, k_cache, v_cache, table, start_locs([1]), lens, 1, kv_len, 0.125)
    torch.testing.assert_close(out, ref, **scaled(TOLERANCE[torch.float32], ref))


@interpreted_only
def test_decode_of_a_padded_row_with_no_context_is_zero():
    from kestrel.kernels.triton import paged_decode
    gen = torch.Generator().manual_seed(2)
    k_cache, v_cache, table = random_paged_cache([20, 1], 1, 64, 16, torch.float32, gen)
    q = torch.randn(2, 4, 64, generator=gen)
    lens = torch.tensor([20, 0], dtype=torch.int32)
    out = paged_decode.decode_attention(q, k_cache, v_cache, table, lens, 0.125, 2)
    assert torch.isfinite(out).all()
    assert torch.equal(out[1], torch.zeros_like(out[1]))


# ------------------------------------------------------------------------------------------------ extend

@interpreted_only
@pytest.mark.parametrize("num_kv_heads,group,head_dim,block_size,dtype", ATTN_CASES)
def test_extend_matches_reference_for_prefill_chunk_verify_and_decode_rows(num_kv_heads, group, head_dim,
                                                                          block_size, dtype):
    from kestrel.attention import torch_ref
    from kestrel.kernels.triton import paged_attention
    gen = torch.Generator().manual_seed(head_dim + block_size + group)
    # full prefill of 20, a 21-token chunk after a 30-token prefix, a 4-token verify after 40, a single decode
    query_lens = [20, 21, 4, 1]
    kv_lens = [20, 51, 44, 9]
    k_cache, v_cache, table = random_paged_cache(kv_lens, num_kv_heads, head_dim, block_size, dtype, gen)
    q = torch.randn(sum(query_lens), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    qsl, lens = start_locs(query_lens), torch.tensor(kv_lens, dtype=torch.int32)
    out = paged_attention.extend_attention(q, k_cache, v_cache, table, qsl, lens, max(query_lens), 0.1)
    ref = torch_ref.paged_attention(q, k_cache, v_cache, table, qsl, lens, max(query_lens), max(kv_lens), 0.1)
    torch.testing.assert_close(out.float(), ref.float(), **scaled(TOLERANCE[dtype], ref.float()))


@interpreted_only
def test_extend_reads_a_strided_query_view():
    from kestrel.attention import torch_ref
    from kestrel.kernels.triton import paged_attention
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache, table = random_paged_cache([12], 2, 64, 4, torch.float32, gen)
    qkv = torch.randn(12, (4 + 2 + 2) * 64, generator=gen)
    q = qkv[:, : 4 * 64].view(12, 4, 64)           # a slice of a fused projection, not contiguous
    qsl, lens = start_locs([12]), torch.tensor([12], dtype=torch.int32)
    out = paged_attention.extend_attention(q, k_cache, v_cache, table, qsl, lens, 12, 0.125)
    ref = torch_ref.paged_attention(q.contiguous(), k_cache, v_cache, table, qsl, lens, 12, 12, 0.125)
    torch.testing.assert_close(out, ref, **scaled(TOLERANCE[torch.float32], ref))


# ------------------------------------------------------------------------------------------------ backend

@interpreted_only
@pytest.mark.parametrize("with_graph_buffers", [False, True])
def test_triton_backend_matches_torch_backend_on_extend_then_decode(with_graph_buffers):
    from kestrel.attention.torch_ref import TorchAttentionBackend
    from kestrel.attention.triton_backend import TritonAttentionBackend
    from kestrel.batch import build_forward_batch
    gen = torch.Generator().manual_seed(4)
    block_size, num_kv_heads, head_dim, num_heads = 4, 2, 64, 8
    tables = [[5, 2, 7], [0, 3], [6, 1, 4]]
    caches = {name: (torch.zeros(8, block_size, num_kv_heads, head_dim),
                     torch.zeros(8, block_size, num_kv_heads, head_dim)) for name in ("torch", "triton")}
    backends = {"torch": TorchAttentionBackend(), "triton": TritonAttentionBackend()}
    if with_graph_buffers:
        backends["triton"].init_graph_buffers(8, 3, torch.device("cpu"))
    # step 1: prefill 9, 6 and 10 tokens; step 2: one decode token each
    steps = [build_forward_batch([[1] * 9, [1] * 6, [1] * 10], [0, 0, 0], tables, block_size),
             build_forward_batch([[1], [1], [1]], [9, 6, 10], tables, block_size)]
    for batch in steps:
        q = torch.randn(batch.num_tokens, num_heads, head_dim, generator=gen)
        k = torch.randn(batch.num_tokens, num_kv_heads, head_dim, generator=gen)
        v = torch.randn(batch.num_tokens, num_kv_heads, head_dim, generator=gen)
        outs = {name: backend.forward(q, k, v, *caches[name], batch, 0.125) for name, backend in backends.items()}
        torch.testing.assert_close(outs["triton"], outs["torch"],
                               **scaled(TOLERANCE[torch.float32], outs["torch"]))
        assert torch.equal(caches["triton"][0], caches["torch"][0])
    assert backends["triton"].supports_graphs()


# ------------------------------------------------------------------------------------------------ fused ops

@interpreted_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_kernel_matches_reference(dtype, with_residual):
    from kestrel.kernels.triton import fused_ops
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(5, 96, generator=gen).to(dtype)    # 96: not a power of two
    weight = torch.randn(96, generator=gen).to(dtype)
    residual = torch.randn(5, 96, generator=gen).to(dtype) if with_residual else None
    got = fused_ops.rms_norm(x, weight, 1e-6, residual)
    want = fused_ops.rms_norm_ref(x, weight, 1e-6, residual)
    if not with_residual:
        got, want = (got,), (want,)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        torch.testing.assert_close(g.float(), w.float(), **scaled(TOLERANCE[dtype], w.float()))


@interpreted_only
def test_rms_norm_kernel_normalises_per_head_for_qk_norm():
    from kestrel.kernels.triton import fused_ops
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(3, 4, 64, generator=gen)
    weight = torch.randn(64, generator=gen)
    torch.testing.assert_close(fused_ops.rms_norm(x, weight, 1e-6), fused_ops.rms_norm_ref(x, weight, 1e-6))


@interpreted_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_silu_and_mul_kernel_matches_reference(dtype):
    from kestrel.kernels.triton import fused_ops
    x = torch.randn(4, 2 * 80, generator=torch.Generator().manual_seed(7)).to(dtype)
    got, want = fused_ops.silu_and_mul(x), fused_ops.silu_and_mul_ref(x)
    assert got.shape == (4, 80)
    torch.testing.assert_close(got.float(), want.float(), **scaled(TOLERANCE[dtype], want.float()))


def _cos_sin_cache(rot_dim: int, max_pos: int = 256) -> torch.Tensor:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2).float() / rot_dim))
    freqs = torch.outer(torch.arange(max_pos).float(), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


@interpreted_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim,rot_dim", [(64, 64), (128, 128), (64, 32)])
def test_rotary_kernel_rotates_q_and_k_in_place_like_reference(dtype, head_dim, rot_dim):
    from kestrel.kernels.triton import fused_ops
    gen = torch.Generator().manual_seed(head_dim + rot_dim)
    # q and k as strided views of one fused qkv projection, the way a model hands them over
    qkv = torch.randn(6, (4 + 2 + 2) * head_dim, generator=gen).to(dtype)
    q = qkv[:, : 4 * head_dim].view(6, 4, head_dim)
    k = qkv[:, 4 * head_dim: 6 * head_dim].view(6, 2, head_dim)
    positions = torch.tensor([0, 1, 7, 200, 5, 5])
    cache = _cos_sin_cache(rot_dim)
    want_q, want_k = fused_ops.apply_rotary_ref(q.clone(), k.clone(), positions, cache)
    v_before = qkv[:, 6 * head_dim:].clone()
    got_q, got_k = fused_ops.apply_rotary(q, k, positions, cache)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()   # in place
    torch.testing.assert_close(q.float(), want_q.float(), **scaled(TOLERANCE[dtype], want_q.float()))
    torch.testing.assert_close(k.float(), want_k.float(), **scaled(TOLERANCE[dtype], want_k.float()))
    assert torch.equal(qkv[:, 6 * head_dim:], v_before)   # v untouched


# ------------------------------------------------------------------------------------------------ selection

def test_select_backend_defaults_to_torch_on_cpu_and_refuses_gpu_backends():
    from kestrel.attention.select import available_backends, select_backend
    from kestrel.attention.torch_ref import TorchAttentionBackend
    from kestrel.errors import KestrelError
    assert isinstance(select_backend(None, "cpu"), TorchAttentionBackend)
    assert isinstance(select_backend("torch", torch.device("cpu")), TorchAttentionBackend)
    assert available_backends("cpu") == ["torch"]
    for name in ("triton", "flashinfer"):
        with pytest.raises(KestrelError, match="needs a CUDA device"):
            select_backend(name, "cpu")
    with pytest.raises(KestrelError, match="'bogus'.*torch, triton, flashinfer"):
        select_backend("bogus", "cpu")


def test_flashinfer_backend_refuses_head_sizes_it_cannot_run():
    """FlashInfer 0.5's prefill fails to build (FA3) or faults (FA2, flashinfer#4299) for head sizes other than
    64/128/256: the backend says so before launching anything."""
    from kestrel.attention.flashinfer_backend import check_head_dim
    from kestrel.errors import KestrelError
    for ok in (64, 128, 256):
        check_head_dim(ok)
    for bad in (16, 80, 96):
        with pytest.raises(KestrelError, match=f"head_dim .*has {bad}; choose --attention-backend triton"):
            check_head_dim(bad)
