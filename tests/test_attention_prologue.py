"""qk_norm_rope_store (one kernel: per-head q/k RMSNorm, rotary, paged K/V write) agrees with its torch reference.

The kernel runs on CPU in Triton's interpreter, in a child pytest started with TRITON_INTERPRET=1, for the reason
and with the interpreter gaps tests/test_triton_kernels.py describes. Rotary subtracts two products rounded to the
model dtype (x1 * cos - x2 * sin), so a 16-bit output inherits the rounding error of those products, not of itself:
where the kernel's rounding differs from the reference's (the interpreter truncates fp32->bf16 casts; the
kernel's fp32 sum for the norm runs in another order, so x * rstd can round one ulp apart), the output is off by
ulps of the largest product. 16-bit comparisons therefore allow 3 ulps of the tensor's largest value (a rotation
keeps each pair's norm, so no product is larger); fp32 is held to the fused-op tolerances. The model-level test at the end runs in this process
with the torch reference installed as the prologue: same greedy tokens as the unfused layer.
"""
from __future__ import annotations

import pytest
import torch

from tests.test_triton_kernels import TOLERANCE, random_paged_cache
from tests.tolerances import scaled
from tests.triton_interpreter import INTERPRETED, run_file_under_interpreter
from tests.triton_interpreter import interpreted_only as interpreted_only_marker

interpreted_only = interpreted_only_marker("test_prologue_under_triton_interpreter")


@pytest.mark.slow   # a child pytest running the file's kernels in Triton's interpreter
@pytest.mark.skipif(INTERPRETED, reason="this is the interpreter child")
def test_prologue_under_triton_interpreter():
    run_file_under_interpreter(__file__, min_passed=10)   # all but the ones that skip in the child


def cos_sin_cache(head_dim: int, max_pos: int = 512, base: float = 10000.0) -> torch.Tensor:
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(max_pos).float(), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def prologue_inputs(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                    dtype: torch.dtype, qk_norm: bool, seed: int, pad_cols: int = 0):
    """qkv as a row slice of a wider buffer (row stride > width), noisy caches, slots with -1 padding."""
    gen = torch.Generator().manual_seed(seed)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = (2 * torch.randn(num_tokens, width + pad_cols, generator=gen)).to(dtype)[:, :width]
    weights = [(1 + 0.5 * torch.randn(head_dim, generator=gen)).to(dtype) if qk_norm else None for _ in range(2)]
    k_cache, v_cache, _ = random_paged_cache([num_tokens + 5], num_kv_heads, head_dim, block_size, dtype, gen)
    num_slots = k_cache.shape[0] * block_size
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens]
    slots[1::3] = -1                                   # padding rows: nothing may be written for them
    positions = torch.randint(0, 512, (num_tokens,), generator=gen)
    return qkv, weights, positions, k_cache, v_cache, slots


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    tol = scaled(TOLERANCE[want.dtype], want)
    if want.dtype != torch.float32 and want.numel():
        tol["atol"] = max(tol["atol"], 3 * torch.finfo(want.dtype).eps * want.float().abs().max().item())
    torch.testing.assert_close(got.float(), want.float(), **tol)


CASES = [  # (num_kv_heads, group, head_dim, block_size, dtype, qk_norm): every dtype with qk-norm, GQA 1/4/8
    (2, 1, 64, 2, torch.float32, True),
    (1, 4, 128, 16, torch.float32, False),
    (2, 4, 64, 16, torch.bfloat16, True),
    (1, 8, 128, 2, torch.bfloat16, True),
    (1, 8, 64, 2, torch.bfloat16, False),
    (2, 4, 128, 2, torch.float16, True),
    (1, 8, 64, 16, torch.float16, False),
]


@interpreted_only
@pytest.mark.parametrize("num_kv_heads,group,head_dim,block_size,dtype,qk_norm", CASES)
def test_kernel_matches_reference_q_and_cache(num_kv_heads, group, head_dim, block_size, dtype, qk_norm):
    from kestrel.kernels.triton.attention_prologue import qk_norm_rope_store, qk_norm_rope_store_ref
    num_heads = num_kv_heads * group
    qkv, (q_w, k_w), positions, k_cache, v_cache, slots = prologue_inputs(
        7, num_heads, num_kv_heads, head_dim, block_size, dtype, qk_norm, seed=head_dim + group, pad_cols=16)
    cache = cos_sin_cache(head_dim)
    qkv_before = qkv.clone()
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want_q = qk_norm_rope_store_ref(qkv, q_w, k_w, 1e-6, positions, cache, want_k, want_v, slots,
                                    num_heads, num_kv_heads, head_dim)
    untouched_k = k_cache.clone()
    q = qk_norm_rope_store(qkv, q_w, k_w, 1e-6, positions, cache, k_cache, v_cache, slots,
                           num_heads, num_kv_heads, head_dim)
    assert q.shape == (7, num_heads, head_dim) and q.dtype == dtype and q.is_contiguous()
    assert_close(q, want_q)
    assert_close(k_cache, want_k)
    assert torch.equal(v_cache, want_v)                       # v is copied, not computed
    written = torch.zeros(k_cache.shape[:2], dtype=torch.bool)
    written.view(-1)[slots[slots >= 0]] = True
    assert torch.equal(k_cache[~written], untouched_k[~written])   # slot -1 rows and other slots untouched
    assert not torch.equal(k_cache[written], untouched_k[written])
    assert torch.equal(qkv, qkv_before)                       # the GEMM output is read only


@interpreted_only
def test_kernel_without_qk_norm_is_rotary_then_store_kv():
    from kestrel.kernels.triton import paged_attention
    from kestrel.kernels.triton import fused_ops
    from kestrel.kernels.triton.attention_prologue import qk_norm_rope_store
    qkv, _, positions, k_cache, v_cache, slots = prologue_inputs(5, 4, 2, 64, 4, torch.float32, False, seed=9)
    cache = cos_sin_cache(64)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    q_ref, k_ref, v_ref = qkv.clone().split([256, 128, 128], dim=-1)
    q_ref, k_ref = fused_ops.apply_rotary(q_ref.view(5, 4, 64), k_ref.view(5, 2, 64), positions, cache)
    paged_attention.store_kv(k_ref, v_ref.view(5, 2, 64), want_k, want_v, slots)
    q = qk_norm_rope_store(qkv, None, None, 1e-6, positions, cache, k_cache, v_cache, slots, 4, 2, 64)
    assert_close(q, q_ref)
    assert_close(k_cache, want_k)
    assert torch.equal(v_cache, want_v)


@interpreted_only
def test_kernel_with_no_tokens_returns_an_empty_q():
    from kestrel.kernels.triton.attention_prologue import qk_norm_rope_store
    qkv, (q_w, k_w), positions, k_cache, v_cache, slots = prologue_inputs(0, 4, 2, 64, 4, torch.float32, True,
                                                                          seed=1)
    before = k_cache.clone()
    q = qk_norm_rope_store(qkv, q_w, k_w, 1e-6, positions, cos_sin_cache(64), k_cache, v_cache, slots, 4, 2, 64)
    assert q.shape == (0, 4, 64) and torch.equal(k_cache, before)


@interpreted_only
def test_triton_backend_handed_prewritten_kv_attends_like_the_unfused_layer():
    from kestrel.attention.triton_backend import TritonAttentionBackend
    from kestrel.batch import build_forward_batch
    from kestrel.kernels.triton import fused_ops
    from kestrel.kernels.triton.attention_prologue import qk_norm_rope_store
    gen = torch.Generator().manual_seed(11)
    block_size, num_heads, num_kv_heads, head_dim = 4, 8, 2, 64
    q_w, k_w = (1 + 0.5 * torch.randn(head_dim, generator=gen) for _ in range(2))
    cache = cos_sin_cache(head_dim)
    tables = [[5, 2, 7], [0, 3], [6, 1, 4]]
    caches = {path: (torch.zeros(8, block_size, num_kv_heads, head_dim),
                     torch.zeros(8, block_size, num_kv_heads, head_dim)) for path in ("unfused", "fused")}
    backend = TritonAttentionBackend()
    assert backend.supports_prewritten_kv()
    # step 1: prefill 9, 6 and 10 tokens; step 2: one decode token each
    for batch in (build_forward_batch([[1] * 9, [1] * 6, [1] * 10], [0, 0, 0], tables, block_size),
                  build_forward_batch([[1], [1], [1]], [9, 6, 10], tables, block_size)):
        qkv = torch.randn(batch.num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
        q, k, v = qkv.clone().split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1)
        q = fused_ops.rms_norm(q.view(-1, num_heads, head_dim), q_w, 1e-6)
        k = fused_ops.rms_norm(k.view(-1, num_kv_heads, head_dim), k_w, 1e-6)
        q, k = fused_ops.apply_rotary(q, k, batch.positions, cache)
        backend.prepare(batch)
        want = backend.forward(q, k, v.view(-1, num_kv_heads, head_dim), *caches["unfused"], batch, 0.125)
        q = qk_norm_rope_store(qkv, q_w, k_w, 1e-6, batch.positions, cache, *caches["fused"], batch.slot_mapping,
                               num_heads, num_kv_heads, head_dim)
        got = backend.forward(q, None, None, *caches["fused"], batch, 0.125)
        assert_close(got, want)
        assert_close(caches["fused"][0], caches["unfused"][0])
        assert torch.equal(caches["fused"][1], caches["unfused"][1])


# ------------------------------------------------------------------------------------------------ in the model

@pytest.mark.skipif(INTERPRETED, reason="runs in the normal process")
def test_qwen3_with_reference_prologue_gives_the_unfused_greedy_tokens(checkpoint_factory):
    from kestrel import LLM, SamplingParams
    from kestrel.kernels.triton.attention_prologue import qk_norm_rope_store_ref
    path = str(checkpoint_factory("qwen3"))
    prompts = ["def add(a, b):\n    return a + b\n", "import os", "x = [i * i for i in range(10)]\nprint("]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    kw = dict(device="cpu", block_size=4, max_num_batched_tokens=16)   # chunked prefill, then decode
    plain = LLM(model=path, **kw).generate(prompts, params)
    llm = LLM(model=path, **kw)
    runner = llm.engine.runner
    assert runner.backend.supports_prewritten_kv()
    calls = []
    for layer in runner.model.layers:
        assert layer.self_attn.q_norm is not None and layer.self_attn.prologue is None
        layer.self_attn.prologue = lambda *a, _f=qk_norm_rope_store_ref, **kw: calls.append(1) or _f(*a, **kw)
    fused = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in fused] == [o.outputs[0].token_ids for o in plain]
    assert len(calls) > 2 * 10     # every layer of every step went through the prologue


@pytest.mark.skipif(INTERPRETED, reason="runs in the normal process")
def test_prologue_is_cuda_only_and_refused_by_backends_that_write_kv_themselves():
    from kestrel.envs import DevSwitches
    from kestrel.layers.ops import TORCH_OPS, choose_layer_ops

    class WritesItsOwnKV:   # e.g. the flashinfer backend: no supports_prewritten_kv
        name = "writes-kv"

        def supports_prewritten_kv(self) -> bool:
            return False

    class AcceptsPrewrittenKV(WritesItsOwnKV):
        def supports_prewritten_kv(self) -> bool:
            return True

    assert choose_layer_ops(torch.device("cpu"), AcceptsPrewrittenKV(), DevSwitches()) is TORCH_OPS
    cuda = torch.device("cuda")
    assert choose_layer_ops(cuda, AcceptsPrewrittenKV(), DevSwitches(fused_ops=False)) is TORCH_OPS
    assert choose_layer_ops(cuda, WritesItsOwnKV(), DevSwitches()).attn_prologue is None
    assert choose_layer_ops(cuda, AcceptsPrewrittenKV(), DevSwitches()).attn_prologue is not None
