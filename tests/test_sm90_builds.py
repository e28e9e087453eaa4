"""The kernels whose next settings await an H200 A/B build for sm_90 (tests/sm90.py: Triton's ptxas, no GPU), so a
device call is not spent finding a compile error: decode attention at each tile and warp count the suite tries,
and the fused logits cast + argmax. The interpreter tests hold their numerics; tests/gpu their results on the GPU."""
from __future__ import annotations

import pytest

from tests.sm90 import compile_for_sm90
from tests.triton_interpreter import INTERPRETED

pytestmark = pytest.mark.skipif(INTERPRETED, reason="compiles; nothing to interpret")

# As the decode graphs bind them: int64 block tables and lengths (views of the runner's int64 buffers).
DECODE_TYPES = {"block_table_ptr": "*i64", "kv_lens_ptr": "*i64", "part_out_ptr": "*fp32",
                "part_lse_ptr": "*fp32", "counter_ptr": "*i32", "scale_log2": "fp32"}


@pytest.mark.parametrize("block_n,warps", [(32, 4), (16, 4), (32, 2), (64, 4)])
@pytest.mark.parametrize("prefetch", [True, False])
def test_decode_kernel_builds_for_sm90(block_n, warps, prefetch):
    from kestrel.attention.triton_kernels import _decode_kernel
    constexprs = dict(GROUP=2, HEAD_DIM=128, BLOCK_H=16, BLOCK_D=128, BLOCK_N=block_n, BLOCK_SIZE=16,
                      DOT_FP32=False, DOT_PRECISION="tf32", INTERPRET=False, MERGE=True, BLOCK_S=32, USE_PDL=True,
                      PREFETCH=prefetch)
    ptx = compile_for_sm90(_decode_kernel, constexprs, DECODE_TYPES)
    assert "griddepcontrol.wait" in ptx and "atom" in ptx   # the PDL wait and the merge's counter


def test_logits_argmax_kernel_builds_for_sm90():
    from kestrel.layers.logits_argmax import BLOCK, MAX_CHUNKS, _logits_argmax_kernel
    ptx = compile_for_sm90(_logits_argmax_kernel,
                           dict(NUM_CHUNKS=38, BLOCK=BLOCK, BLOCK_C=64, MAX_CHUNKS=MAX_CHUNKS, USE_PDL=True),
                           {"out_ptr": "*fp32", "tokens_ptr": "*i64", "part_max_ptr": "*fp32",
                            "part_idx_ptr": "*i32", "counter_ptr": "*i32"})
    assert "atom" in ptx and "ld.global.cg" in ptx   # the row counter, and partials read past L1
