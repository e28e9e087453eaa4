"""The resident matmul's build, on CPU: NVRTC compiles layers/resident_gemv.cu for Hopper at the Llama-3.1-8B's
o_proj shape under the register cap that lets a block sit beside a cluster decode program, and its config fills
one wave with shared memory that fits beside that program. Its numbers are checked on the GPU
(tests/gpu/test_resident_gemv_gpu.py)."""
from __future__ import annotations

import re

import pytest

from kestrel import cuda_rtc
from kestrel.attention import cluster_decode
from kestrel.layers import resident_gemv

needs_nvrtc = pytest.mark.skipif(not cuda_rtc.nvrtc_available(), reason="NVRTC (nvidia-cuda-nvrtc) not installed")
H200_SMS = 132
SM_SHARED = 228 * 1024          # an H200 SM's shared memory
BLOCK_RESERVE = 1024            # reserved per resident block


def test_config_for_the_8b_o_proj_is_one_wave_that_fits_beside_cluster_decode():
    config = resident_gemv.config_for(4096, 4096, H200_SMS)
    assert config == resident_gemv.ResidentConfig(rows=32, smem_k=2816)     # 128 blocks; 1,280 of K streamed
    decode = cluster_decode.shared_bytes(cluster_decode.num_warps(4, 128), 4, 128)
    assert config.shared_bytes(4096) + 128 + BLOCK_RESERVE + decode + BLOCK_RESERVE <= SM_SHARED
    assert config.shared_bytes(4096) <= 227 * 1024                             # a block's opt-in limit


def test_config_refuses_what_cannot_stream_through_its_staged_part():
    assert resident_gemv.config_for(4096, 16384, H200_SMS) is None             # 2,560 of K staged, 13,824 left
    assert resident_gemv.config_for(256, 1024, H200_SMS).smem_k == 1024        # all of K staged


@needs_nvrtc
@pytest.mark.parametrize("budget_kb", [188, 160])
def test_builds_for_hopper_under_the_register_cap(budget_kb):
    config = resident_gemv.config_for(4096, 4096, H200_SMS, budget_kb * 1024)
    built = resident_gemv.compile_kernel(4096, config)
    # a block beside a group-4 cluster decode program: 65,536 - 8 warps x 32 x 216 registers = 10,240 = 4 x 32 x 80
    assert built.spill_bytes() == 0 and 0 < built.registers() <= 80, built.log
    ptx = built.ptx
    assert "cp.async.bulk.shared::cluster.global" in ptx and "cp.async.bulk.prefetch.L2" in ptx
    # x is read with ordinary (not read-only) loads: the attention kernel before this one writes it
    assert not re.search(r"ld\.global\.nc", ptx)
    assert ptx.index("griddepcontrol.launch_dependents") > ptx.index("griddepcontrol.wait")
