"""decode_attention_from_qkv (attention prologue + split-K decode in one launch) equals the two-launch path,
qk_norm_rope_store then decode_attention: the same output (fp32: bit-equal or within 1e-6; 16-bit: within the
kernel tests' TOLERANCE), bit-identical K/V caches, the split counters back at zero.

Kernels run on CPU in Triton's interpreter, in a child pytest started with TRITON_INTERPRET=1, for the reason
tests/test_triton_kernels.py describes. An engine on CPU uses the torch backend, so this kernel test is the
contract on CPU; tests/gpu/test_fused_decode_gpu.py runs whole engines with the flag on and off.
"""
from __future__ import annotations

import pytest
import torch

from tests.test_attention_prologue import cos_sin_cache
from tests.test_triton_kernels import TOLERANCE, random_paged_cache
from tests.triton_interpreter import INTERPRETED, run_file_under_interpreter
from tests.triton_interpreter import interpreted_only as interpreted_only_marker

interpreted_only = interpreted_only_marker("test_fused_decode_under_triton_interpreter")


@pytest.mark.skipif(INTERPRETED, reason="this is the interpreter child")
def test_fused_decode_under_triton_interpreter():
    run_file_under_interpreter(__file__)


def decode_inputs(kv_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                  dtype: torch.dtype, qk_norm: bool, seed: int):
    """A decode batch: qkv as a row slice of a wider buffer, noisy paged caches, each row's slot at position
    kv_len - 1 of its block table (-1 for a padded row, kv_len 0), positions kv_len - 1 (0 when padded)."""
    gen = torch.Generator().manual_seed(seed)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = (2 * torch.randn(len(kv_lens), width + 16, generator=gen)).to(dtype)[:, :width]
    weights = [(1 + 0.5 * torch.randn(head_dim, generator=gen)).to(dtype) if qk_norm else None for _ in range(2)]
    k_cache, v_cache, table = random_paged_cache([max(n, 1) for n in kv_lens], num_kv_heads, head_dim, block_size,
                                                 dtype, gen)
    slots = torch.tensor([int(table[s, (n - 1) // block_size]) * block_size + (n - 1) % block_size if n else -1
                          for s, n in enumerate(kv_lens)], dtype=torch.int64)
    positions = torch.tensor([max(n - 1, 0) for n in kv_lens], dtype=torch.int64)
    lens = torch.tensor(kv_lens, dtype=torch.int32)
    return qkv, weights, positions, k_cache, v_cache, slots, table, lens


def two_launches(qkv, q_w, k_w, positions, cache, k_cache, v_cache, slots, table, lens, heads, num_splits,
                 partials=None):
    from kestrel.attention.triton_kernels import decode_attention
    from kestrel.layers.attention_prologue import qk_norm_rope_store
    num_heads, num_kv_heads, head_dim = heads
    q = qk_norm_rope_store(qkv, q_w, k_w, 1e-6, positions, cache, k_cache, v_cache, slots, *heads)
    return decode_attention(q, k_cache, v_cache, table, lens, head_dim ** -0.5, num_splits, partials)


def one_launch(qkv, q_w, k_w, positions, cache, k_cache, v_cache, slots, table, lens, heads, num_splits,
               partials=None):
    from kestrel.attention.fused_decode import decode_attention_from_qkv
    return decode_attention_from_qkv(qkv, q_w, k_w, 1e-6, positions, cache, k_cache, v_cache, slots, table, lens,
                                     *heads, heads[2] ** -0.5, num_splits, partials)


def assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    """The contract: fp32 within 1e-6, 16-bit within the kernel tests' TOLERANCE. Under the interpreter the two
    paths run the same operations on the same values (q rounded to the model dtype like the prologue's, then the
    shared decode body), so they are also bit-equal, in every dtype: a q left unrounded shows here."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    else:
        torch.testing.assert_close(got.float(), want.float(), **TOLERANCE[want.dtype])
    assert torch.equal(got, want)


@pytest.fixture(params=["grid_order", "reversed"])
def program_order(request, monkeypatch):
    """The interpreter runs programs one after another in grid order, so split 0 runs before the last split and
    a kernel whose new K/V were written by the wrong program (one that runs first) would pass. "reversed" runs
    them in the opposite order: a program that reads a slot before another writes it then sees stale K/V."""
    if request.param == "reversed":
        from triton.runtime import interpreter
        builder = interpreter.interpreter_builder
        set_grid_idx = builder.set_grid_idx

        def reversed_idx(x, y, z):
            nx, ny, nz = builder.grid_dim
            set_grid_idx(nx - 1 - x, ny - 1 - y, nz - 1 - z)

        monkeypatch.setattr(builder, "set_grid_idx", reversed_idx)
    return request.param


CASES = [  # (num_kv_heads, group, head_dim, block_size, dtype, qk_norm): every dtype, GQA 1/4/8, D 64/128
    (2, 1, 64, 2, torch.float32, True),
    (2, 1, 128, 16, torch.float32, False),
    (1, 4, 128, 16, torch.float32, True),
    (2, 8, 64, 2, torch.float32, False),
    (2, 4, 64, 16, torch.bfloat16, True),
    (1, 8, 128, 2, torch.bfloat16, False),
    (2, 4, 128, 2, torch.float16, True),
    (1, 8, 64, 16, torch.float16, False),
]
# 75 spans several 16-token tiles and all of 3 splits; 0 is a padded row (slot -1); 16 / 17 end on / just past
# a tile edge, so with 3 splits the new token is the first key of the last used split.
KV_LENS = [1, 75, 0, 17, 33, 16]


@interpreted_only
@pytest.mark.parametrize("num_kv_heads,group,head_dim,block_size,dtype,qk_norm", CASES)
@pytest.mark.parametrize("num_splits", [1, 3, None])
@pytest.mark.parametrize("merge", ["atomic", "reduce"])
def test_one_launch_equals_prologue_then_decode(num_kv_heads, group, head_dim, block_size, dtype, qk_norm,
                                                num_splits, merge, monkeypatch, program_order):
    monkeypatch.setenv("KESTREL_DECODE_MERGE", merge)
    from kestrel.attention.triton_kernels import alloc_decode_partials
    num_heads = num_kv_heads * group
    heads = (num_heads, num_kv_heads, head_dim)
    qkv, (q_w, k_w), positions, k_cache, v_cache, slots, table, lens = decode_inputs(
        KV_LENS, num_heads, num_kv_heads, head_dim, block_size, dtype, qk_norm, seed=head_dim + group + block_size)
    cache = cos_sin_cache(head_dim)
    qkv_before = qkv.clone()
    caches = {path: (k_cache.clone(), v_cache.clone()) for path in ("two", "one")}
    partials = {path: alloc_decode_partials(8, num_heads, num_kv_heads, head_dim, qkv.device)
                for path in ("two", "one")}
    want = two_launches(qkv, q_w, k_w, positions, cache, *caches["two"], slots, table, lens, heads, num_splits,
                        partials["two"])
    got = one_launch(qkv, q_w, k_w, positions, cache, *caches["one"], slots, table, lens, heads, num_splits,
                     partials["one"])
    assert_same(got, want)
    assert torch.equal(caches["one"][0], caches["two"][0]) and torch.equal(caches["one"][1], caches["two"][1])
    assert not torch.equal(caches["one"][0], k_cache)            # the new tokens were written
    assert torch.equal(got[2], torch.zeros_like(got[2]))         # the padded row
    assert torch.count_nonzero(partials["one"][2]) == 0, f"counters left at {partials['one'][2].tolist()}"
    assert torch.equal(qkv, qkv_before)                          # the GEMM output is read only


@interpreted_only
def test_one_launch_without_scratch_or_splits_given_and_fp32_bit_equal():
    num_heads, num_kv_heads, head_dim = 8, 2, 64
    heads = (num_heads, num_kv_heads, head_dim)
    qkv, (q_w, k_w), positions, k_cache, v_cache, slots, table, lens = decode_inputs(
        [40, 5, 1], num_heads, num_kv_heads, head_dim, 4, torch.float32, True, seed=3)
    cache = cos_sin_cache(head_dim)
    caches = {path: (k_cache.clone(), v_cache.clone()) for path in ("two", "one")}
    want = two_launches(qkv, q_w, k_w, positions, cache, *caches["two"], slots, table, lens, heads, None)
    got = one_launch(qkv, q_w, k_w, positions, cache, *caches["one"], slots, table, lens, heads, None)
    assert torch.equal(got, want)   # same q bits, same attention code: bit-equal under the interpreter
    assert torch.equal(caches["one"][0], caches["two"][0]) and torch.equal(caches["one"][1], caches["two"][1])


@interpreted_only
def test_one_launch_reuses_static_scratch_as_lengths_change_like_a_graph_replay(program_order):
    from kestrel.attention.triton_kernels import alloc_decode_partials
    num_heads, num_kv_heads, head_dim, block_size = 8, 2, 64, 4
    heads = (num_heads, num_kv_heads, head_dim)
    cache = cos_sin_cache(head_dim)
    partials = alloc_decode_partials(6, num_heads, num_kv_heads, head_dim, torch.device("cpu"))
    for step, kv_lens in enumerate(([70, 3, 0], [16, 64, 0], [1, 33, 65], [0, 0, 0])):
        qkv, (q_w, k_w), positions, k_cache, v_cache, slots, table, lens = decode_inputs(
            kv_lens, num_heads, num_kv_heads, head_dim, block_size, torch.float32, True, seed=step)
        caches = {path: (k_cache.clone(), v_cache.clone()) for path in ("two", "one")}
        want = two_launches(qkv, q_w, k_w, positions, cache, *caches["two"], slots, table, lens, heads, 4)
        got = one_launch(qkv, q_w, k_w, positions, cache, *caches["one"], slots, table, lens, heads, 4, partials)
        assert_same(got, want)
        assert torch.equal(caches["one"][0], caches["two"][0]) and torch.equal(caches["one"][1], caches["two"][1])
        assert torch.count_nonzero(partials[2]) == 0


@interpreted_only
def test_triton_backend_decodes_from_qkv_only_with_the_flag(monkeypatch):
    from kestrel.attention.torch_ref import TorchAttentionBackend
    from kestrel.attention.triton_backend import TritonAttentionBackend
    from kestrel.forward.batch import build_forward_batch
    monkeypatch.delenv("KESTREL_FUSED_DECODE_PROLOGUE", raising=False)
    backend = TritonAttentionBackend()
    assert not backend.decodes_from_qkv() and not TorchAttentionBackend().decodes_from_qkv()
    monkeypatch.setenv("KESTREL_FUSED_DECODE_PROLOGUE", "1")
    assert backend.decodes_from_qkv() and not TorchAttentionBackend().decodes_from_qkv()

    gen = torch.Generator().manual_seed(11)
    block_size, num_heads, num_kv_heads, head_dim = 4, 8, 2, 64
    heads = (num_heads, num_kv_heads, head_dim)
    q_w, k_w = (1 + 0.5 * torch.randn(head_dim, generator=gen) for _ in range(2))
    cache = cos_sin_cache(head_dim)
    tables = [[5, 2, 7], [0, 3], [6, 1, 4]]
    backend.init_graph_buffers(4, 3, torch.device("cpu"))   # static scratch, as under CUDA graphs
    batch = build_forward_batch([[1], [1], [1]], [9, 6, 10], tables, block_size)
    caches = {path: (torch.randn(8, block_size, num_kv_heads, head_dim, generator=gen),
                     torch.randn(8, block_size, num_kv_heads, head_dim, generator=gen)) for path in ("two",)}
    caches["one"] = tuple(c.clone() for c in caches["two"])
    qkv = torch.randn(3, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    want = two_launches(qkv, q_w, k_w, batch.positions, cache, *caches["two"], batch.slot_mapping,
                        batch.block_table, batch.kv_lens, heads, None)
    backend.prepare(batch)
    got = backend.decode_from_qkv(qkv, q_w, k_w, 1e-6, batch.positions, cache, *caches["one"], batch, *heads,
                                  head_dim ** -0.5)
    assert_same(got, want)
    assert torch.equal(caches["one"][0], caches["two"][0]) and torch.equal(caches["one"][1], caches["two"][1])
