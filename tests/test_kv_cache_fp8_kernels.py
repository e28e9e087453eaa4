"""FP8 KV cache (--kv-cache-dtype fp8) in the Triton kernels, under Triton's interpreter on the CPU, against the
torch reference that dequantizes (kernels/kv_store.py, attention/torch_ref.py): the K/V write (store_kv and the
fused prologue) writes the reference's e4m3 bytes, and every reader (extend for prefill, chunks and tree verify,
split-K decode, MLA's latent decode) attends over the same FP8 cache as the reference does, scales included.

Both sides read the same e4m3 bytes and dequantize them exactly (e4m3 -> fp32 is exact, the scale a multiply), so
the bounds are the float32 kernels' own (tests/test_triton_kernels.py), not FP8's rounding.

Interpreter gaps (Triton 3.6): its fp32 -> e4m3 cast drops the carry when rounding up reaches the next power of
two (1.97 -> 1.0, not 2.0), rounds ties away from zero (not to even) and is a step off on some subnormals; so
interpreted writes are compared by assert_same_e4m3, which allows those and nothing else; compiled kernels round
in hardware and tests/gpu/test_kv_cache_fp8_gpu.py compares their bytes exactly.
"""
from __future__ import annotations

import pytest
import torch

from tests.tolerances import scaled
from tests.triton_interpreter import INTERPRETED, run_file_under_interpreter
from tests.triton_interpreter import interpreted_only as interpreted_only_marker

interpreted_only = interpreted_only_marker("test_fp8_kv_kernels_under_triton_interpreter")
FP8 = torch.float8_e4m3fn
TOL = dict(atol=2e-5, rtol=2e-5)   # float32 queries: the kernels' own error, scaled() grows it with the values
K_SCALE, V_SCALE = 0.75, 1.5       # not 1.0, so a scale applied twice, or not at all, shows


@pytest.mark.slow   # a child pytest running the file's kernels in Triton's interpreter
@pytest.mark.skipif(INTERPRETED, reason="this is the interpreter child")
def test_fp8_kv_kernels_under_triton_interpreter():
    run_file_under_interpreter(__file__, min_passed=12)


def fp8_paged_cache(kv_lens: list[int], num_kv_heads: int, head_dim: int, block_size: int, gen: torch.Generator):
    """FP8 caches of noise (quantized with K_SCALE / V_SCALE) and a table of shuffled blocks, one spare -1 column."""
    from kestrel.kernels.kv_store import quantize

    needed = [-(-n // block_size) for n in kv_lens]
    num_blocks = sum(needed) + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = quantize(2 * torch.randn(shape, generator=gen), torch.empty(0, dtype=FP8), K_SCALE)
    v_cache = quantize(2 * torch.randn(shape, generator=gen), torch.empty(0, dtype=FP8), V_SCALE)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.full((len(kv_lens), max(needed) + 1), -1, dtype=torch.int32)
    for s, n in enumerate(needed):
        table[s, :n] = torch.tensor(order[:n], dtype=torch.int32)
        order = order[n:]
    return k_cache, v_cache, table


def e4m3_step(x: torch.Tensor) -> torch.Tensor:
    """The spacing of e4m3 values at |x|: 2^(exponent - 3) for normal values, 2^-9 below 2^-6 (subnormals)."""
    exponent = torch.frexp(x.abs()).exponent - 1
    return torch.exp2((exponent - 3).clamp(min=-9).float())


def assert_same_e4m3(ours: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal e4m3 values but for the interpreter's rounding gaps (module docstring): a value may be the
    reference's neighbour (ties away from zero, subnormals), or half a power-of-two reference (the dropped
    carry). A wrong or missing scale moves values by far more than a step, and most values are exact anyway."""
    a, b = ours.float(), ref.float()
    differ = a != b
    if not differ.any():
        return
    got, want = a[differ], b[differ]
    carry = (torch.frexp(want.abs()).mantissa == 0.5) & (got == (want / 2).to(FP8).float())
    neighbour = (got - want).abs() <= e4m3_step(torch.maximum(got.abs(), want.abs()))
    ok = carry | neighbour
    assert ok.all(), f"{int((~ok).sum())} values differ beyond the interpreter's rounding gaps: {got[~ok][:8]} " \
        f"vs {want[~ok][:8]}"
    assert differ.float().mean() < 0.05, f"{differ.float().mean():.1%} of the values differ"


def start_locs(query_lens: list[int]) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32)


@interpreted_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_kernel_writes_the_reference_e4m3_bytes_and_clamps(dtype):
    from kestrel.kernels import kv_store
    from kestrel.kernels.triton import paged_attention

    gen = torch.Generator().manual_seed(1)
    k_cache = torch.zeros(6, 4, 2, 64, dtype=FP8)
    v_cache = torch.zeros_like(k_cache)
    k = (3 * torch.randn(7, 2, 64, generator=gen)).to(dtype)
    v = (3 * torch.randn(7, 2, 64, generator=gen)).to(dtype)
    k[0, 0, :4] = torch.tensor([1000.0, -1000.0, 500.0, 0.0])   # past e4m3's +-448 once divided: clamped
    slots = torch.tensor([3, -1, 0, 17, -1, 5, 22])
    want_k, want_v = k_cache.clone(), v_cache.clone()
    kv_store.store_kv(k, v, want_k, want_v, slots, K_SCALE, V_SCALE)
    paged_attention.store_kv(k, v, k_cache, v_cache, slots, K_SCALE, V_SCALE)
    assert_same_e4m3(k_cache, want_k)
    assert_same_e4m3(v_cache, want_v)
    assert k_cache.view(-1, 2, 64)[3, 0, :2].float().tolist() == [448.0, -448.0]


@interpreted_only
@pytest.mark.parametrize("group,block_size", [(1, 2), (4, 16)])
def test_extend_over_an_fp8_cache_matches_the_dequantizing_reference(group, block_size):
    from kestrel.attention import torch_ref
    from kestrel.kernels.triton import paged_attention

    gen = torch.Generator().manual_seed(group + block_size)
    query_lens, kv_lens = [20, 21, 4, 1], [20, 51, 44, 9]   # prefill, a chunk after a prefix, verify, decode
    k_cache, v_cache, table = fp8_paged_cache(kv_lens, 2, 64, block_size, gen)
    q = torch.randn(sum(query_lens), 2 * group, 64, generator=gen)
    qsl, lens = start_locs(query_lens), torch.tensor(kv_lens, dtype=torch.int32)
    out = paged_attention.extend_attention(q, k_cache, v_cache, table, qsl, lens, max(query_lens), 0.125,
                                           k_scale=K_SCALE, v_scale=V_SCALE)
    ref = torch_ref.paged_attention(q, k_cache, v_cache, table, qsl, lens, max(query_lens), max(kv_lens), 0.125,
                                    k_scale=K_SCALE, v_scale=V_SCALE)
    torch.testing.assert_close(out, ref, **scaled(TOL, ref))


@interpreted_only
def test_tree_verify_over_an_fp8_cache_matches_the_dequantizing_reference():
    from kestrel.attention import torch_ref
    from kestrel.kernels.triton import paged_attention

    gen = torch.Generator().manual_seed(7)
    query_lens, kv_lens = [4, 3], [30, 12]
    k_cache, v_cache, table = fp8_paged_cache(kv_lens, 2, 64, 4, gen)
    q = torch.randn(sum(query_lens), 4, 64, generator=gen)
    tree = torch.zeros(2, 4, 4, dtype=torch.bool)
    for i, parents in enumerate(([], [0], [0], [0, 1])):   # root 0, children 1 and 2, node 3 under 1
        tree[:, i, i] = True
        tree[:, i, parents] = True
    qsl, lens = start_locs(query_lens), torch.tensor(kv_lens, dtype=torch.int32)
    out = paged_attention.extend_attention(q, k_cache, v_cache, table, qsl, lens, 4, 0.125, tree,
                                           K_SCALE, V_SCALE)
    ref = torch_ref.paged_attention(q, k_cache, v_cache, table, qsl, lens, 4, 30, 0.125, tree, K_SCALE, V_SCALE)
    torch.testing.assert_close(out, ref, **scaled(TOL, ref))


@interpreted_only
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_split_k_decode_over_an_fp8_cache_matches_the_dequantizing_reference(num_splits, q_dtype):
    from kestrel.attention import torch_ref
    from kestrel.kernels.triton import paged_decode

    gen = torch.Generator().manual_seed(num_splits)
    kv_lens = [1, 17, 75]
    k_cache, v_cache, table = fp8_paged_cache(kv_lens, 2, 64, 4, gen)
    q = torch.randn(3, 8, 64, generator=gen).to(q_dtype)
    lens = torch.tensor(kv_lens, dtype=torch.int32)
    out = paged_decode.decode_attention(q, k_cache, v_cache, table, lens, 0.125, num_splits,
                                        k_scale=K_SCALE, v_scale=V_SCALE)
    ref = torch_ref.paged_attention(q, k_cache, v_cache, table, start_locs([1, 1, 1]), lens, 1, 75, 0.125,
                                    k_scale=K_SCALE, v_scale=V_SCALE)
    tol = TOL if q_dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)   # bf16 output rounding
    torch.testing.assert_close(out.float(), ref.float(), **scaled(tol, ref.float()))


@interpreted_only
def test_fused_prologue_writes_the_reference_fp8_cache():
    from kestrel.kernels.triton.attention_prologue import qk_norm_rope_store, qk_norm_rope_store_ref
    from tests.test_attention_prologue import cos_sin_cache, prologue_inputs

    qkv, (q_w, k_w), positions, k_cache, v_cache, slots = prologue_inputs(
        7, 8, 2, 64, 4, torch.float32, True, seed=3, pad_cols=0)
    k_cache, v_cache = torch.zeros_like(k_cache, dtype=FP8), torch.zeros_like(v_cache, dtype=FP8)
    cache = cos_sin_cache(64)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want_q = qk_norm_rope_store_ref(qkv, q_w, k_w, 1e-6, positions, cache, want_k, want_v, slots, 8, 2, 64,
                                    k_scale=K_SCALE, v_scale=V_SCALE)
    q = qk_norm_rope_store(qkv, q_w, k_w, 1e-6, positions, cache, k_cache, v_cache, slots, 8, 2, 64,
                           k_scale=K_SCALE, v_scale=V_SCALE)
    torch.testing.assert_close(q, want_q, **scaled(TOL, want_q))
    assert_same_e4m3(k_cache, want_k)
    assert_same_e4m3(v_cache, want_v)


@interpreted_only
def test_triton_backend_over_an_fp8_cache_matches_the_torch_backend_step_by_step():
    """Prefill then decode through both backends, each writing its own FP8 cache: the same bytes (up to the
    interpreter's rounding), the same output over them."""
    from kestrel.attention.torch_ref import TorchAttentionBackend
    from kestrel.attention.triton_backend import TritonAttentionBackend
    from kestrel.batch import build_forward_batch

    gen = torch.Generator().manual_seed(4)
    tables = [[5, 2, 7], [0, 3], [6, 1, 4]]
    caches = {name: (torch.zeros(8, 4, 2, 64, dtype=FP8), torch.zeros(8, 4, 2, 64, dtype=FP8))
              for name in ("torch", "triton")}
    backends = {"torch": TorchAttentionBackend(), "triton": TritonAttentionBackend()}
    backends["triton"].init_graph_buffers(8, 3, torch.device("cpu"))   # the graph-static scratch road
    steps = [build_forward_batch([[1] * 9, [1] * 6, [1] * 10], [0, 0, 0], tables, 4),
             build_forward_batch([[1], [1], [1]], [9, 6, 10], tables, 4)]
    for batch in steps:
        q = torch.randn(batch.num_tokens, 8, 64, generator=gen)
        k = torch.randn(batch.num_tokens, 2, 64, generator=gen)
        v = torch.randn(batch.num_tokens, 2, 64, generator=gen)
        want = backends["torch"].forward(q, k, v, *caches["torch"], batch, 0.125, K_SCALE, V_SCALE)
        backends["triton"].forward(q, k, v, *caches["triton"], batch, 0.125, K_SCALE, V_SCALE)
        assert_same_e4m3(caches["triton"][0], caches["torch"][0])
        assert_same_e4m3(caches["triton"][1], caches["torch"][1])
        # the interpreter's rounding gaps aside, the same bytes: read the reference's, as the K/V were prewritten
        for ours, ref in zip(caches["triton"], caches["torch"]):
            ours.copy_(ref)
        out = backends["triton"].forward(q, None, None, *caches["triton"], batch, 0.125, K_SCALE, V_SCALE)
        torch.testing.assert_close(out, want, **scaled(TOL, want))


@interpreted_only
def test_latent_decode_over_an_fp8_latent_cache_matches_the_torch_absorbed_form():
    from kestrel.attention.torch_ref import TorchAttentionBackend
    from kestrel.kernels.kv_store import quantize
    from kestrel.kernels.triton import latent_decode
    from tests.test_mla_triton_decode import decode_problem

    rank, rope, heads = 64, 16, 32
    kv_lens = [50, 3, 0, 17]
    batch, cache, q_nope, q_pe, w_uk, w_uv = decode_problem(kv_lens, heads, rank, rope, torch.int32, seed=5)
    cache = quantize(cache, torch.empty(0, dtype=FP8), K_SCALE)
    q = torch.cat([torch.einsum("thn,hnr->thr", q_nope, w_uk), q_pe], dim=-1)
    scale = (16 + rope) ** -0.5
    ours = latent_decode.latent_decode_attention(q, cache, batch.block_table, batch.kv_lens, scale, num_splits=2,
                                                 latent_scale=K_SCALE)
    ref = TorchAttentionBackend().forward(q, None, None, cache, cache, batch, scale, K_SCALE, K_SCALE)
    real = [i for i, n in enumerate(kv_lens) if n]
    torch.testing.assert_close(ours[real, :, :rank], ref[real, :, :rank], **scaled(TOL, ref[real, :, :rank]))
