"""Compiled Triton kernels and the fast attention backends agree with the torch references on CUDA.

Same contract as tests/test_triton_kernels.py (which runs the kernels in Triton's CPU interpreter), here at
realistic shapes, through the compiled path, and under CUDA-graph capture and replay.
"""
from __future__ import annotations

import pytest
import torch

from tests.test_triton_kernels import TOLERANCE, random_paged_cache, start_locs

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ATTN_CASES = [  # (num_kv_heads, group, head_dim, block_size, dtype)
    (8, 1, 128, 16, torch.bfloat16),
    (8, 4, 128, 16, torch.bfloat16),    # Llama-3-8B
    (4, 8, 128, 16, torch.float16),
    (2, 8, 64, 2, torch.bfloat16),
    (4, 4, 64, 32, torch.float32),
]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _paged(kv_lens, num_kv_heads, head_dim, block_size, dtype, seed):
    k_cache, v_cache, table = random_paged_cache(kv_lens, num_kv_heads, head_dim, block_size, dtype, _gen(seed))
    return k_cache.cuda(), v_cache.cuda(), table.cuda()


@pytest.mark.parametrize("num_kv_heads,group,head_dim,block_size,dtype", ATTN_CASES)
@pytest.mark.parametrize("num_splits", [1, 8, None])
def test_decode_matches_reference(num_kv_heads, group, head_dim, block_size, dtype, num_splits):
    from kestrel.attention import torch_ref
    from kestrel.kernels.triton import paged_decode
    kv_lens = [1, 63, 64, 65, 517, 2048, 3001, 4096] * 4     # 32 sequences, tile and split boundaries
    k_cache, v_cache, table = _paged(kv_lens, num_kv_heads, head_dim, block_size, dtype, seed=head_dim + group)
    q = torch.randn(len(kv_lens), num_kv_heads * group, head_dim, generator=_gen(1)).to(dtype).cuda()
    lens = torch.tensor(kv_lens, dtype=torch.int32, device="cuda")
    out = paged_decode.decode_attention(q, k_cache, v_cache, table, lens, head_dim ** -0.5, num_splits)
    ref = torch_ref.paged_attention(q, k_cache, v_cache, table, start_locs([1] * len(kv_lens)).cuda(), lens, 1,
                                    max(kv_lens), head_dim ** -0.5)
    torch.testing.assert_close(out.float(), ref.float(), **TOLERANCE[dtype])


@pytest.mark.parametrize("num_kv_heads,group,head_dim,block_size,dtype", ATTN_CASES)
def test_extend_matches_reference(num_kv_heads, group, head_dim, block_size, dtype):
    from kestrel.attention import torch_ref
    from kestrel.kernels.triton import paged_attention
    # full prefill, chunk after a long prefix, speculative verify, single-token rows, odd lengths
    query_lens = [1000, 512, 5, 1, 77, 1]
    kv_lens = [1000, 2560, 1205, 300, 77, 1]
    k_cache, v_cache, table = _paged(kv_lens, num_kv_heads, head_dim, block_size, dtype, seed=group)
    q = torch.randn(sum(query_lens), num_kv_heads * group, head_dim, generator=_gen(2)).to(dtype).cuda()
    qsl, lens = start_locs(query_lens).cuda(), torch.tensor(kv_lens, dtype=torch.int32, device="cuda")
    out = paged_attention.extend_attention(q, k_cache, v_cache, table, qsl, lens, max(query_lens),
                                          head_dim ** -0.5)
    ref = torch_ref.paged_attention(q, k_cache, v_cache, table, qsl, lens, max(query_lens), max(kv_lens),
                                    head_dim ** -0.5)
    torch.testing.assert_close(out.float(), ref.float(), **TOLERANCE[dtype])


def test_store_kv_matches_reference():
    from kestrel.attention import torch_ref
    from kestrel.kernels.triton import paged_attention
    k_cache, v_cache, _ = _paged([4096], 8, 128, 16, torch.bfloat16, seed=3)
    slots = torch.randperm(4096, generator=_gen(4))[:700].cuda()
    slots[::7] = -1
    k = torch.randn(700, 8, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(700, 8, 128, device="cuda", dtype=torch.bfloat16)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    torch_ref.store_kv(k, v, want_k, want_v, slots)
    paged_attention.store_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_decode_captured_in_a_cuda_graph_replays_new_lengths_and_tables():
    from kestrel.attention import torch_ref
    from kestrel.kernels.triton import paged_decode
    num_seqs, kv_heads, heads, head_dim, block_size = 16, 8, 32, 128, 16
    k_cache, v_cache, _ = _paged([8192], kv_heads, head_dim, block_size, torch.bfloat16, seed=5)
    table = torch.zeros(num_seqs, 128, dtype=torch.int32, device="cuda")        # capacity 2048 tokens
    lens = torch.ones(num_seqs, dtype=torch.int32, device="cuda")
    q = torch.zeros(num_seqs, heads, head_dim, dtype=torch.bfloat16, device="cuda")
    partials = paged_decode.alloc_decode_partials(num_seqs, heads, kv_heads, head_dim, q.device)
    paged_decode.decode_attention(q, k_cache, v_cache, table, lens, 0.088, partials=partials)   # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_decode.decode_attention(q, k_cache, v_cache, table, lens, 0.088, partials=partials)
    gen = _gen(6)
    for step in range(3):
        new_lens = torch.randint(0, 2049, (num_seqs,), generator=gen, dtype=torch.int32)
        new_lens[step] = 0                                                          # a padded row
        q.copy_(torch.randn(num_seqs, heads, head_dim, generator=gen).to(torch.bfloat16))
        lens.copy_(new_lens)
        table.copy_(torch.randint(0, 512, (num_seqs, 128), generator=gen, dtype=torch.int32))
        graph.replay()
        ref = torch_ref.paged_attention(q, k_cache, v_cache, table, start_locs([1] * num_seqs).cuda(), lens, 1,
                                        2048, 0.088)
        torch.testing.assert_close(out.float(), ref.float(), **TOLERANCE[torch.bfloat16])
        assert torch.equal(out[step], torch.zeros_like(out[step]))
        assert torch.count_nonzero(partials[2]) == 0   # the split counters are back at zero for the next replay


# ------------------------------------------------------------------------------------------------ backends

def _backend_steps(block_size: int):
    from kestrel.batch import build_forward_batch
    tables = [list(range(s * 40, s * 40 + 40)) for s in range(4)]     # 4 sequences, 40 blocks each
    prompt_lens = [300, 17, 129, 64]
    prefill = build_forward_batch([[1] * n for n in prompt_lens], [0] * 4, tables, block_size)
    decode = build_forward_batch([[1]] * 4, prompt_lens, tables, block_size)
    return [prefill.to(torch.device("cuda")), decode.to(torch.device("cuda"))]


def _check_backend_against_torch(backend, dtype=torch.bfloat16):
    from kestrel.attention.torch_ref import TorchAttentionBackend
    block_size, kv_heads, heads, head_dim = 16, 8, 32, 128
    caches = {name: tuple(torch.zeros(160, block_size, kv_heads, head_dim, dtype=dtype, device="cuda")
                          for _ in range(2)) for name in ("ref", "fast")}
    ref_backend = TorchAttentionBackend()
    gen = _gen(7)
    for batch in _backend_steps(block_size):
        q, k, v = (torch.randn(batch.num_tokens, h, head_dim, generator=gen).to(dtype).cuda()
                   for h in (heads, kv_heads, kv_heads))
        for b in (ref_backend, backend):
            b.prepare(batch)
        want = ref_backend.forward(q, k, v, *caches["ref"], batch, head_dim ** -0.5)
        got = backend.forward(q, k, v, *caches["fast"], batch, head_dim ** -0.5)
        torch.testing.assert_close(got.float(), want.float(), **TOLERANCE[dtype])
        assert torch.equal(caches["fast"][0], caches["ref"][0])


def test_triton_backend_matches_torch_backend_on_prefill_then_decode():
    from kestrel.attention.select import select_backend
    backend = select_backend(None, "cuda")
    assert backend.name == "triton" and backend.supports_graphs()
    _check_backend_against_torch(backend)
    backend.init_graph_buffers(64, 40, torch.device("cuda"))
    _check_backend_against_torch(backend)


def test_flashinfer_backend_matches_torch_backend_on_prefill_then_decode():
    pytest.importorskip("flashinfer")
    from kestrel.attention.select import select_backend
    _check_backend_against_torch(select_backend("flashinfer", "cuda"))


def test_flashinfer_engine_starts_and_matches_triton_greedy_tokens():
    """The whole startup (JIT phase under inference mode, then KV-cache sizing by a profiled forward) with
    FlashInfer on the default model (head_dim 64): H200 run 3 of session 3 failed here ('Inplace update to
    inference tensor outside InferenceMode')."""
    pytest.importorskip("flashinfer")
    from kestrel import LLM, SamplingParams
    path = None
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompts = ["def add(a, b):", "import os"]
    tokens = {}
    for backend in ("flashinfer", "triton"):
        llm = LLM(model=path, device="cuda", dtype="float16", attention_backend=backend, gpu_memory_utilization=0.3)
        tokens[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        del llm
        torch.cuda.empty_cache()
    # FlashInfer has no fp32 kernels, so 16-bit: another kernel's sum order may flip a near-tie late in a sequence.
    assert [t[:4] for t in tokens["flashinfer"]] == [t[:4] for t in tokens["triton"]]


# ------------------------------------------------------------------------------------------------ fused ops

def _mostly_bit_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    """16-bit results should round exactly like HF almost everywhere (approximate rsqrt/exp move a few)."""
    assert (got == want).float().mean().item() > 0.95


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_kernel_matches_reference(dtype, with_residual):
    from kestrel.kernels.triton import fused_ops
    x = torch.randn(513, 4096, device="cuda").to(dtype)
    weight = torch.randn(4096, device="cuda").to(dtype)
    residual = torch.randn_like(x) if with_residual else None
    got = fused_ops.rms_norm(x, weight, 1e-5, residual)
    want = fused_ops.rms_norm_ref(x, weight, 1e-5, residual)
    for g, w in zip(*((got, want) if with_residual else ((got,), (want,)))):
        torch.testing.assert_close(g.float(), w.float(), **TOLERANCE[dtype])
        if dtype != torch.float32:
            _mostly_bit_equal(g, w)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_silu_and_mul_kernel_matches_reference(dtype):
    from kestrel.kernels.triton import fused_ops
    x = torch.randn(257, 2 * 14336, device="cuda").to(dtype)
    got, want = fused_ops.silu_and_mul(x), fused_ops.silu_and_mul_ref(x)
    torch.testing.assert_close(got.float(), want.float(), **TOLERANCE[dtype])
    if dtype != torch.float32:
        _mostly_bit_equal(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_kernel_matches_reference(dtype, head_dim):
    from kestrel.kernels.triton import fused_ops
    tokens, heads, kv_heads = 300, 32, 8
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device="cuda").to(dtype)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim: (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    positions = torch.randint(0, 8192, (tokens,), device="cuda")
    inv_freq = 1.0 / (500000 ** (torch.arange(0, head_dim, 2, device="cuda").float() / head_dim))
    freqs = torch.outer(torch.arange(8192, device="cuda").float(), inv_freq)
    cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    want_q, want_k = fused_ops.apply_rotary_ref(q.clone(), k.clone(), positions, cache)
    fused_ops.apply_rotary(q, k, positions, cache)
    # The kernel rotates in fp32 and rounds once; HF (the reference) multiplies and adds in 16-bit, rounding
    # three times, so ~20% of 16-bit outputs differ by an ulp (measured on the H200): close, not bit-equal.
    for g, w in ((q, want_q), (k, want_k)):
        torch.testing.assert_close(g.float(), w.float(), **TOLERANCE[dtype])
