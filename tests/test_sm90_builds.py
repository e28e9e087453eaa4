"""The decode step's Triton kernels build for sm_90 (tests/sm90.py: Triton's ptxas, no GPU), so GPU time is not
spent finding a compile error: decode attention with its in-launch merge, the fused logits cast + argmax, and where
the PDL kernels signal (after their wait, once). The interpreter tests hold their numerics; tests/gpu their results
on the GPU."""
from __future__ import annotations

import pytest

from tests.sm90 import compile_for_sm90
from tests.triton_interpreter import INTERPRETED

pytestmark = [pytest.mark.skipif(INTERPRETED, reason="compiles; nothing to interpret"), pytest.mark.slow]

# As the decode graphs bind them: int64 block tables and lengths (views of the runner's int64 buffers).
DECODE_TYPES = {"block_table_ptr": "*i64", "kv_lens_ptr": "*i64", "part_out_ptr": "*fp32",
                "part_lse_ptr": "*fp32", "counter_ptr": "*i32", "scale_log2": "fp32"}


@pytest.mark.parametrize("group", [2, 4])   # Qwen3-0.6B, Llama-3.1-8B
def test_decode_kernel_builds_for_sm90(group):
    from kestrel.kernels.triton.paged_decode import _decode_kernel
    constexprs = dict(GROUP=group, HEAD_DIM=128, BLOCK_H=16, BLOCK_D=128, BLOCK_N=32, BLOCK_SIZE=16,
                      DOT_FP32=False, DOT_PRECISION="tf32", INTERPRET=False, BLOCK_S=32, USE_PDL=True)
    ptx = compile_for_sm90(_decode_kernel, constexprs, DECODE_TYPES, dict(num_warps=4, num_stages=2))
    assert "griddepcontrol.wait" in ptx and "atom" in ptx   # the PDL wait and the merge's counter
    # the first tile's K/V (bf16) is read before the wait, the rest after it
    assert "ld.global" in ptx[:ptx.index("griddepcontrol.wait")]
    # the merge after the counter: loads and multiply-adds, no shuffle, and only the barrier that hands the
    # atomic's result to every thread (the padded-rows merge had 680 shuffles and 67 barriers here)
    merge = ptx.split("atom.")[1]
    assert "shfl" not in merge and merge.count("bar.sync") == 1


def test_logits_argmax_kernel_builds_for_sm90():
    from kestrel.kernels.triton.logits_argmax import BLOCK, MAX_CHUNKS, _logits_argmax_kernel
    ptx = compile_for_sm90(_logits_argmax_kernel,
                           dict(NUM_CHUNKS=38, BLOCK=BLOCK, BLOCK_C=64, MAX_CHUNKS=MAX_CHUNKS, USE_PDL=True),
                           {"out_ptr": "*fp32", "tokens_ptr": "*i64", "part_max_ptr": "*fp32",
                            "part_idx_ptr": "*i32", "counter_ptr": "*i32"})
    assert "atom" in ptx and "ld.global.cg" in ptx   # the row counter, and partials read past L1


def _signal_order(ptx: str) -> list[str]:
    """The griddepcontrol instructions of a kernel's PTX, in program order."""
    return [line.split()[0] for line in ptx.splitlines() if line.strip().startswith("griddepcontrol.")]


def test_pdl_signal_placement_for_sm90():
    """Every PDL kernel of the decode step lets the next kernel launch only after its own wait, and exactly once
    (signalling at the start instead lost on the H200: +3.8% and +5.3% on the 0.6B step, session 8)."""
    use_pdl = True
    from kestrel.kernels.triton.paged_decode import _decode_kernel
    from kestrel.kernels.triton.fused_ops import _rms_norm_kernel
    from kestrel.kernels.triton.gemv import PROLOGUE_RMS, _skinny_matmul_kernel
    skinny = compile_for_sm90(_skinny_matmul_kernel, dict(
        K=1024, PROLOGUE=PROLOGUE_RMS.value, HAS_RES=True, HAS_BIAS=False, BLOCK_M=1, BLOCK_N=16, BLOCK_K=1024,
        USE_DOT=False, FOLD=1, UNROLL=True, DOT_FP32=False, DOT_PRECISION="tf32", USE_PDL=use_pdl,
        ONE_PASS_NORM=False), {"eps": "fp32"})
    norm = compile_for_sm90(_rms_norm_kernel, dict(N=1024, BLOCK=1024, HAS_RESIDUAL=True, USE_PDL=use_pdl),
                            {"eps": "fp32"})
    decode = compile_for_sm90(_decode_kernel, dict(
        GROUP=2, HEAD_DIM=128, BLOCK_H=16, BLOCK_D=128, BLOCK_N=32, BLOCK_SIZE=16, DOT_FP32=False,
        DOT_PRECISION="tf32", INTERPRET=False, BLOCK_S=32, USE_PDL=use_pdl), DECODE_TYPES)
    from kestrel.kernels.triton.attention_prologue import _qk_norm_rope_store_kernel
    from kestrel.kernels.triton.fused_ops import _silu_and_mul_kernel
    from kestrel.kernels.triton.logits_argmax import BLOCK, MAX_CHUNKS, _logits_argmax_kernel
    silu = compile_for_sm90(_silu_and_mul_kernel, dict(I=3072, BLOCK=1024, USE_PDL=use_pdl), {})
    prologue = compile_for_sm90(_qk_norm_rope_store_kernel, dict(
        NUM_HEADS=16, NUM_KV_HEADS=8, HEAD_DIM=128, HALF=64, BLOCK_HALF=64, BLOCK_SIZE=16, HAS_Q_NORM=True,
        HAS_K_NORM=True, USE_PDL=use_pdl, FP8=False),
        {"positions_ptr": "*i64", "cos_sin_ptr": "*fp32", "slot_ptr": "*i64", "eps": "fp32", "k_scale": "fp32",
         "v_scale": "fp32"})
    argmax = compile_for_sm90(_logits_argmax_kernel,
                              dict(NUM_CHUNKS=38, BLOCK=BLOCK, BLOCK_C=64, MAX_CHUNKS=MAX_CHUNKS, USE_PDL=use_pdl),
                              {"out_ptr": "*fp32", "tokens_ptr": "*i64", "part_max_ptr": "*fp32",
                               "part_idx_ptr": "*i32", "counter_ptr": "*i32"})
    for ptx in (skinny, norm, decode, silu, prologue, argmax):
        assert _signal_order(ptx) == ["griddepcontrol.wait;", "griddepcontrol.launch_dependents;"]


@pytest.mark.parametrize("block_m", [1, 4])
def test_one_pass_norm_skinny_matmul_builds_for_sm90(block_m):
    """The one-pass add-RMSNorm (gemv.one_pass_norm) against two passes: more loads before the PDL wait (the norm
    weight joins the weight slice), fewer after it (x and the residual read once)."""
    from kestrel.kernels.triton.gemv import PROLOGUE_RMS, _skinny_matmul_kernel

    def loads_around_wait(one_pass: bool) -> tuple[int, int]:
        ptx = compile_for_sm90(_skinny_matmul_kernel, dict(
            K=1024, PROLOGUE=PROLOGUE_RMS.value, HAS_RES=True, HAS_BIAS=False, BLOCK_M=block_m, BLOCK_N=4,
            BLOCK_K=1024, USE_DOT=False, FOLD=1, UNROLL=True, DOT_FP32=False, DOT_PRECISION="tf32", USE_PDL=True,
            ONE_PASS_NORM=one_pass), {"eps": "fp32"})
        assert _signal_order(ptx) == ["griddepcontrol.wait;", "griddepcontrol.launch_dependents;"]
        before, after = ptx.split("griddepcontrol.wait;")
        return before.count("ld.global"), after.count("ld.global")

    one_before, one_after = loads_around_wait(True)
    two_before, two_after = loads_around_wait(False)
    assert one_before > two_before and one_after < two_after




PROLOGUE_TYPES = {"positions_ptr": "*i64", "cos_sin_ptr": "*fp32", "slot_ptr": "*i64", "eps": "fp32",
                  "k_scale": "fp32", "v_scale": "fp32",
                  **{name: "i64" for name in ("stride_qkv", "stride_q_out_t", "stride_q_out_h", "stride_cos_sin",
                                               "stride_kc_block", "stride_kc_off", "stride_kc_head",
                                               "stride_vc_block", "stride_vc_off", "stride_vc_head")}}


@pytest.mark.parametrize("qk_norm", [False, True])
def test_rotary_kernels_round_each_product_as_hf(qk_norm):
    """The attention prologue and the rotary kernel, built with their launch's HF_ROUNDING: each bf16 product is
    rounded (mul.rn.bf16) before the sum; with Triton's default contraction the product and the sum become one
    fma.rn.bf16 that rounds once (16-19% of q elements an ulp off HF's on the H200, session 13)."""
    from kestrel.kernels.triton.attention_prologue import _qk_norm_rope_store_kernel
    from kestrel.kernels.triton.fused_ops import HF_ROUNDING, _rotary_kernel
    constexprs = dict(NUM_HEADS=32, NUM_KV_HEADS=8, HEAD_DIM=128, HALF=64, BLOCK_HALF=64, BLOCK_SIZE=16,
                      HAS_Q_NORM=qk_norm, HAS_K_NORM=qk_norm, USE_PDL=True, FP8=False)
    contracted = compile_for_sm90(_qk_norm_rope_store_kernel, constexprs, PROLOGUE_TYPES)
    assert "fma.rn.bf16" in contracted                       # what the launch option exists for
    for ptx in (compile_for_sm90(_qk_norm_rope_store_kernel, constexprs, PROLOGUE_TYPES, HF_ROUNDING),
                compile_for_sm90(_rotary_kernel, dict(HALF=64, BLOCK_HALF=64, BLOCK_HQ=32, BLOCK_HK=8),
                                 {"positions_ptr": "*i64", "cache_ptr": "*fp32"}, HF_ROUNDING)):
        assert "fma.rn.bf16" not in ptx
        assert ptx.count("mul.rn.bf16") >= 8 and "sub.rn.bf16" in ptx and "add.rn.bf16" in ptx


def test_fp8_kv_cache_writers_build_for_sm90():
    """--kv-cache-dtype fp8 (issue 53): the attention prologue and the K/V store, with an e4m3 cache, build for
    Hopper and convert to e4m3 there (cvt.rn.satfinite.e4m3x2), the scales arriving as fp32 arguments."""
    from kestrel.kernels.triton.attention_prologue import _qk_norm_rope_store_kernel
    from kestrel.kernels.triton.paged_attention import _store_kv_kernel
    fp8_cache = {"k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv"}
    prologue = compile_for_sm90(_qk_norm_rope_store_kernel, dict(
        NUM_HEADS=32, NUM_KV_HEADS=8, HEAD_DIM=128, HALF=64, BLOCK_HALF=64, BLOCK_SIZE=16, HAS_Q_NORM=True,
        HAS_K_NORM=True, USE_PDL=False, FP8=True), {**PROLOGUE_TYPES, **fp8_cache})
    store = compile_for_sm90(_store_kv_kernel, dict(NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_H=8, BLOCK_D=128,
                                                    BLOCK_SIZE=16, FP8=True),
                             {"slot_ptr": "*i64", "k_scale": "fp32", "v_scale": "fp32", **fp8_cache})
    for ptx in (prologue, store):
        assert "e4m3" in ptx


@pytest.mark.parametrize("quantize_x", [False, True], ids=["w8a16", "w8a8"])
def test_block_fp8_moe_kernels_build_for_sm90(quantize_x):
    """The fused MoE kernels with block-FP8 experts (issue 51), W8A16 and W8A8, build for Hopper: both tiles-path
    kernels and both rows-path kernels, at the Qwen3-30B-A3B-FP8 shape (H 2048, I 768, 128 x 128 scale tiles);
    W8A8's tiles path multiplies on the FP8 tensor cores (e4m3 x e4m3 wgmma)."""
    from kestrel.kernels.triton import fused_moe as moe
    fp8 = dict(FP8=True, SCALE_BN=128, SCALE_BK=128, QUANT_X=quantize_x, EMULATE_FP8=False)
    types = {"w13_ptr": "*fp8e4nv", "w2_ptr": "*fp8e4nv", "s_ptr": "*fp32", "sorted_rows_ptr": "*i32",
             "tile_expert_ptr": "*i32", "ids_ptr": "*i64", "weights_ptr": "*fp32", "out_ptr": "*fp32"}
    tiles = dict(H=2048, I=768, BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, DOT_FP32=False, DOT_PRECISION="tf32",
                 RNE_BF16=False, **fp8)
    gate_up = compile_for_sm90(moe._moe_gate_up_kernel, dict(TOPK=8, **tiles), types)
    down = compile_for_sm90(moe._moe_down_kernel, tiles, types)
    rows = dict(TOPK=8, H=2048, I=768, BLOCK_N=16, BLOCK_K=128, RNE_BF16=False, USE_PDL=False, **fp8)
    compile_for_sm90(moe._moe_gate_up_rows_kernel, rows, types)
    compile_for_sm90(moe._moe_down_sum_rows_kernel, dict(rows, BLOCK_S=8), types)
    for ptx in (gate_up, down):
        assert ("e4m3.e4m3" in ptx) == quantize_x
