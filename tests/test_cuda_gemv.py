"""The CUDA C++ skinny matmul's build, on CPU: NVRTC compiles kestrel/kernels/cuda/skinny_gemv.cu for Hopper at the Llama-3.1-8B's
layer shapes for 1, 2 and 4 rows without spills, and its PTX keeps the PDL contract (only weight loads, on the
read-only L1-bypassing path, before griddepcontrol.wait). Its numbers are checked on the GPU
(tests/gpu/test_cuda_gemv_gpu.py)."""
from __future__ import annotations

import re
from collections import Counter

import pytest
import torch

from kestrel.kernels.cuda import cuda_rtc
from kestrel.kernels.cuda import cuda_gemv

needs_nvrtc = pytest.mark.skipif(not cuda_rtc.nvrtc_available(), reason="NVRTC (nvidia-cuda-nvrtc) not installed")

LAYERS_8B = {  # name: (N out, K, norm folded in, SiLU-mul folded in)
    "qkv": (6144, 4096, True, False), "o": (4096, 4096, False, False),
    "gate_up": (14336, 4096, True, True), "down": (4096, 14336, False, False),
}
STREAM = "ld.global.nc.L1::no_allocate.v4.u32"


def _loads(ptx: str) -> Counter:
    return Counter(re.findall(r"\b(?:ld|st)\.[\w.:]+", ptx))


@needs_nvrtc
@pytest.mark.parametrize("m_tile", [1, 2, 4])
@pytest.mark.parametrize("layer", list(LAYERS_8B))
def test_builds_for_hopper_without_spills_and_only_weights_before_the_wait(layer, m_tile):
    n, k, norm, silu = LAYERS_8B[layer]
    config = cuda_gemv.default_config(n, k, silu, m_tile=m_tile)
    built = cuda_gemv.compile_kernel(k, config, m_tile, norm, silu)
    assert built.spill_bytes() == 0 and 0 < built.registers() <= 128, built.log   # 2 blocks of 256 an SM
    if norm:
        assert f"{2 * k * m_tile + 4 * config.warps * m_tile} bytes smem" in built.log
    wait = built.ptx.index("griddepcontrol.wait")
    before, after = _loads(built.ptx[:wait]), _loads(built.ptx[wait:])
    loads = config.rows * (2 if silu else 1) * config.u
    assert before[STREAM] == loads and before[STREAM] <= cuda_gemv.LOADS_PER_LANE
    # the norm weight too (a weight: no kernel of the step writes it); x, the residual, all writes: after
    assert before["ld.global.nc.v4.u32"] == (k // (8 * 32 * config.warps) if norm else 0)
    assert not any(op.startswith(("st.", "ld.global.v4", "ld.shared")) for op in before)
    assert after[STREAM] == loads   # the later steps' weight loads, in the step loop
    assert built.ptx.index("griddepcontrol.launch_dependents") > wait


@needs_nvrtc
@pytest.mark.parametrize("layer", list(LAYERS_8B))
def test_the_bulk_copied_activation_builds_and_copies_after_the_wait(layer):
    # TMA_X, the one-row build: x (and the residual) arrive by one bulk copy into shared memory, issued after
    # griddepcontrol.wait (the previous kernel writes them); the dot products then read shared memory only
    n, k, norm, silu = LAYERS_8B[layer]
    config = cuda_gemv.default_config(n, k, silu)
    rope = cuda_gemv.RopeShape(128, 32, 8) if layer == "qkv" else None
    built = cuda_gemv.compile_kernel(k, config, 1, norm, silu, rope=rope, tma_x=True)
    assert built.spill_bytes() == 0 and 0 < built.registers() <= 128, built.log
    wait = built.ptx.index("griddepcontrol.wait")
    assert "cp.async.bulk" not in built.ptx[:wait] and "cp.async.bulk.shared" in built.ptx[wait:]
    assert not any(op.startswith("ld.global.v4") for op in _loads(built.ptx))   # x is never read from global
    assert _loads(built.ptx[:wait])[STREAM] == config.rows * (2 if silu else 1) * config.u   # the first step's
    # the price: a row of x (and the residual, with the norm) in shared memory, which ptxas reports
    assert built.shared_bytes() >= k * 2 * (2 if norm else 1), built.log
    with pytest.raises(AssertionError):
        cuda_gemv.compile_kernel(k, config, 2, norm, silu, tma_x=True)


def test_the_bulk_copy_serves_one_aligned_row():
    x = torch.zeros(2, 4096 + 8, dtype=torch.bfloat16)
    assert cuda_gemv.use_bulk_copy(1, x[:1], None) and cuda_gemv.use_bulk_copy(1, x[:1], x[1:])
    assert not cuda_gemv.use_bulk_copy(2, x, None)                      # two rows: read from global
    assert not cuda_gemv.use_bulk_copy(1, x[:1, 1:], None)              # not 16-byte aligned
    assert not cuda_gemv.use_bulk_copy(1, x[:1], x[1:, 1:])


def _blocks_per_sm(registers: int, threads: int, shared_bytes: int) -> int:
    """Resident blocks of one kernel on an H100/H200 SM: 64K registers (8 a thread at a time, rounded up),
    228 KB of shared memory (1 KB a block reserved), at most 2,048 threads."""
    by_registers = 65536 // (-(-registers // 8) * 8 * threads)
    return min(by_registers, 233472 // (shared_bytes + 1024), 2048 // threads)


@needs_nvrtc
def test_the_long_row_default_fits_one_wave_on_the_h200():
    # down on one row a warp is 512 blocks: one wave only at 4 blocks an SM (132 x 4 = 528), which its build's
    # registers must allow
    config = cuda_gemv.default_config(4096, 14336)
    blocks = 4096 // (config.rows * config.warps)
    built = cuda_gemv.compile_kernel(14336, config, 1, False, False, tma_x=True)
    assert _blocks_per_sm(built.registers(), 32 * config.warps, built.shared_bytes()) * 132 >= blocks == 512


def blocks_per_sm(registers: int, threads: int, shared_bytes: int) -> int:
    """Resident blocks of one kernel on an H100/H200 SM: 64K registers (8 a thread at a time, rounded up),
    228 KB of shared memory (1 KB a block reserved), at most 2,048 threads."""
    by_registers = 65536 // (-(-registers // 8) * 8 * threads)
    return min(by_registers, 233472 // (shared_bytes + 1024), 2048 // threads)


def test_default_configs_fill_whole_waves_on_the_h200():
    assert cuda_gemv.default_config(6144, 4096) == cuda_gemv.CudaGemvConfig(rows=3, u=4)       # 256 blocks
    assert cuda_gemv.default_config(4096, 4096) == cuda_gemv.CudaGemvConfig(rows=2, u=8)       # 256 blocks
    assert cuda_gemv.default_config(14336, 4096, silu=True) == cuda_gemv.CudaGemvConfig(rows=1, u=8)
    assert cuda_gemv.default_config(4096, 14336) == cuda_gemv.CudaGemvConfig(rows=1, u=8)      # the long-row rule
    assert cuda_gemv.default_config(4096, 14336, m_tile=4) == cuda_gemv.CudaGemvConfig(rows=2, u=4)
    for n, k, _, silu in LAYERS_8B.values():   # a step divides K
        assert k % (256 * cuda_gemv.default_config(n, k, silu).u) == 0


def test_never_usable_on_cpu():
    x, w = torch.zeros(1, 4096, dtype=torch.bfloat16), torch.zeros(64, 4096, dtype=torch.bfloat16)
    assert not cuda_gemv.usable(x, w)


@needs_nvrtc
@pytest.mark.parametrize("m_tile", [1, 2, 4])
def test_rotary_fold_builds_for_the_8b_qkv_without_spills(m_tile):
    """The QKV projection with the attention prologue folded in (ROPE): the plain config, no spills, and
    positions, slots and cos/sin read only after the wait (a kernel of the step writes positions and slots)."""
    config = cuda_gemv.default_config(6144, 4096, m_tile=m_tile)
    built = cuda_gemv.compile_kernel(4096, config, m_tile, True, False, rope=cuda_gemv.RopeShape(128, 32, 8))
    assert built.spill_bytes() == 0 and 0 < built.registers() <= 128, built.log
    wait = built.ptx.index("griddepcontrol.wait")
    before = _loads(built.ptx[:wait])
    assert set(before) <= {STREAM, "ld.global.nc.v4.u32", "ld.param.u64", "ld.param.u32", "ld.param.f32"}, before
    after = _loads(built.ptx[wait:])
    assert after["ld.global.u64"] >= 2 and after["ld.global.u32"] >= 2   # positions, slots; cos and sin (bits)
    assert after["st.global.u16"] >= 2                                   # the pair's two outputs
