"""The cluster decode kernel's build, on CPU: NVRTC (the nvidia-cuda-nvrtc wheel, no GPU needed) compiles
kestrel/kernels/cuda/cluster_decode.cu for Hopper at the real models' shapes, and its PTX keeps the ordering the kernel's PDL
contract needs. Its numbers are checked on the GPU (tests/gpu/test_cluster_decode_gpu.py)."""
from __future__ import annotations

import re
from collections import Counter

import pytest
import torch

from kestrel.kernels.cuda import cuda_rtc
from kestrel.kernels.cuda import cluster_decode
from kestrel.envs import switches

needs_nvrtc = pytest.mark.skipif(not cuda_rtc.nvrtc_available(), reason="NVRTC (nvidia-cuda-nvrtc) not installed")


def _loads(ptx: str) -> Counter:
    return Counter(re.findall(r"\bld\.[\w.:]+", ptx))


@needs_nvrtc
@pytest.mark.parametrize("group,cluster,index64", [(2, 8, True), (4, 8, True), (2, 16, False), (8, 2, False)])
def test_the_kernel_builds_for_hopper_without_spills(group, cluster, index64):   # Qwen3-0.6B, Llama-3.1-8B, ...
    built = cluster_decode.compile_kernel(group, 128, cluster, 16, "sm_90", index64, tensor_cores=False)
    assert built.spill_bytes() == 0, built.log
    warps = cluster_decode.num_warps(group, 128)
    assert f"{cluster_decode.shared_bytes(warps, group, 128)} bytes smem" in built.log
    assert warps == (8 if group <= 4 else 4)
    assert 0 < built.registers() <= 255, built.log
    assert len(built.cubin) > 0


@needs_nvrtc
def test_kv_is_read_before_the_pdl_wait_and_the_merge_goes_through_peers_shared_memory():
    group, cluster = 2, 8
    ptx = cluster_decode.compile_kernel(group, 128, cluster, 16, "sm_90", tensor_cores=False).ptx
    wait = ptx.index("griddepcontrol.wait")
    before, after = _loads(ptx[:wait]), _loads(ptx[wait:])
    # one 16-byte K and one V load per prefetched key (8 dims a lane at head_dim 128), issued before the wait
    assert before["ld.global.v4.u32"] == 2 * cluster_decode.prefetch(group) == 2 * cluster_decode.PREFETCH
    # q and the caches are written by the kernel before this one while it runs: never the read-only path
    assert not any(op.startswith("ld.global.nc.v4") for op in before + after)
    # each output element reads m, l and acc from every program of the cluster
    assert after["ld.shared::cluster.f32"] == 3 * cluster
    # one barrier before the peers' reads (release/acquire: the partials), one before leaving (reads done)
    assert ptx.count("barrier.cluster.arrive.release") == 1 and ptx.count("barrier.cluster.arrive.relaxed") == 1
    assert ptx.count("barrier.cluster.wait.acquire") == 2
    assert ptx.index("griddepcontrol.launch_dependents") > wait
    assert "atom." not in ptx and "membar" not in ptx and "fence" not in ptx


@needs_nvrtc
@pytest.mark.parametrize("group,head_dim", [(2, 128), (4, 128), (1, 64), (8, 64), (8, 128)])
def test_the_tensor_core_build_fits_in_registers(group, head_dim):
    """KESTREL_CLUSTER_DECODE_MMA=1 at the real models' shapes and the GQA and head-dim ends: no spills, 4 warps,
    and the tiles' MMAs (scores: 2 n-tiles x head_dim / 16 k-steps; output: head_dim / 16 m-tiles, a tile)."""
    tile_count = cluster_decode.tiles(head_dim)
    built = cluster_decode.compile_kernel(group, head_dim, 8, 16, "sm_90", True, tensor_cores=True)
    assert built.spill_bytes() == 0 and 0 < built.registers() <= 255, built.log
    assert cluster_decode.num_warps(group, head_dim, True) == 4
    assert f"{cluster_decode.shared_bytes(4, group, head_dim, True)} bytes smem" in built.log
    # the first chunk's tiles and the loop's: (2 + 1) * head_dim / 16 MMAs a tile, once for each
    assert built.ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == 2 * tile_count * 3 * head_dim // 16


@needs_nvrtc
def test_the_tensor_core_build_reads_its_tiles_before_the_wait():
    ptx = cluster_decode.compile_kernel(4, 128, 8, 16, "sm_90", True, tensor_cores=True).ptx
    wait = ptx.index("griddepcontrol.wait")
    before = _loads(ptx[:wait])
    # per tile a lane reads 2 keys' K (4 vectors each) and 4 keys' V (2 vectors each): 16 loads of 16 bytes
    assert before["ld.global.v4.u32"] == 16 * cluster_decode.tiles(128)
    assert not any(op.startswith("ld.global.nc.v4") for op in _loads(ptx))
    assert _loads(ptx[wait:])["ld.shared::cluster.f32"] == 3 * 8


@needs_nvrtc
@pytest.mark.parametrize("tensor_cores", [True, False])
def test_the_next_kernel_may_launch_right_after_the_wait(tensor_cores):
    # launch_dependents once, right after griddepcontrol.wait and before any work past it (its MMAs or its q . k)
    work = "mma.sync" if tensor_cores else "shfl.sync"
    ptx = cluster_decode.compile_kernel(4, 128, 8, 16, "sm_90", True, tensor_cores=tensor_cores).ptx
    wait, signal = ptx.index("griddepcontrol.wait"), ptx.index("griddepcontrol.launch_dependents")
    assert ptx.count("griddepcontrol.launch_dependents") == 1 and wait < signal < ptx.index(work, wait)


def test_the_tensor_core_build_is_on_from_a_group_of_4_and_never_at_head_dim_256(monkeypatch):
    monkeypatch.delenv("KESTREL_CLUSTER_DECODE_MMA", raising=False)
    assert cluster_decode.mma(4, 128) and cluster_decode.mma(8, 64)                  # Llama-3.1-8B: group 4
    assert not cluster_decode.mma(2, 128) and not cluster_decode.mma(4, 256)         # Qwen3-0.6B: group 2
    monkeypatch.setenv("KESTREL_CLUSTER_DECODE_MMA", "1")
    switches.cache_clear()
    assert cluster_decode.mma(2, 128) and cluster_decode.mma(1, 64) and not cluster_decode.mma(8, 256)
    monkeypatch.setenv("KESTREL_CLUSTER_DECODE_MMA", "0")
    switches.cache_clear()
    assert not cluster_decode.mma(4, 128)
    monkeypatch.setenv("KESTREL_CLUSTER_DECODE_MMA", "yes")
    switches.cache_clear()
    with pytest.raises(ValueError, match="KESTREL_CLUSTER_DECODE_MMA='yes'"):
        cluster_decode.mma(4, 128)
    assert cluster_decode.defines(4, 128, 8, 16, True, 4, True, 2)["MMA"] == 1
    assert "MMA" not in cluster_decode.defines(4, 128, 8, 16, True, 8)


@needs_nvrtc
def test_a_compile_error_raises_with_nvrtc_log():
    with pytest.raises(RuntimeError, match="not_a_type"):
        cuda_rtc.compile_cubin("__global__ void k() { not_a_type x; }", "broken", "sm_90", {})


def test_the_kernel_is_on_by_default_but_never_on_cpu(monkeypatch):
    q = torch.zeros(1, 16, 128, dtype=torch.bfloat16)
    cache = torch.zeros(4, 16, 8, 128, dtype=torch.bfloat16)
    monkeypatch.delenv("KESTREL_CLUSTER_DECODE", raising=False)
    assert switches().cluster_decode and not cluster_decode.usable(q, cache, cache, 1)   # CPU tensors
    monkeypatch.setenv("KESTREL_CLUSTER_DECODE", "0")
    switches.cache_clear()
    assert not switches().cluster_decode
    monkeypatch.setenv("KESTREL_CLUSTER_DECODE", "8")   # on or off only: the programs a kv head are CLUSTER
    switches.cache_clear()
    with pytest.raises(ValueError, match="KESTREL_CLUSTER_DECODE='8'"):
        cluster_decode.usable(q, cache, cache, 1)
