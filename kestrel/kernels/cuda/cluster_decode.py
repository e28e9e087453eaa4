"""Decode attention whose context splits merge inside a thread-block cluster (cluster_decode.cu; Hopper, bf16).

The Triton decode kernel (paged_attention.py) merges its splits through global memory. Its last split program
pays for the partial stores, a release fence, the counter atomic and a round of L2 loads before the output
exists: 2.25 us a layer on the Qwen3-0.6B bs1 step (timed by taking the merge out). Triton 3.6 cannot reach
distributed shared memory, so this kernel is CUDA C++, compiled by NVRTC at first use (kestrel/kernels/cuda/cuda_rtc.py) and launched
with a cluster shape and PDL.

It is the default for decode batches of at most MAX_SEQS sequences (KESTREL_CLUSTER_DECODE=0 keeps the Triton
kernel; kestrel/envs.py): on the H200, against the Triton kernel, the Qwen3-0.6B bs1 step −3.7% to −4.9%, the
Llama-3.1-8B step within its noise. The CLUSTER programs of a kv head split its context (16 gained half as much as
8). Other batches, dtypes and devices, and any machine where the kernel does not build, keep the Triton kernel.

The kernel has two builds. On CUDA cores each key is split over 16 lanes and its scores are summed with
shuffles; at bs1 that arithmetic was most of the kernel's time after the PDL wait (3.2 us at a group of 4). On
tensor cores (KESTREL_CLUSTER_DECODE_MMA, by default for groups of 4 and more) a warp attends to 16-key tiles with
mma.sync: 0.6 us, and the Llama-3.1-8B bs1 step −2.3 to −2.5%.
"""
from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from kestrel.kernels.cuda import cuda_rtc
from kestrel.kernels.triton.paged_attention import LOG2E
from kestrel.envs import switches
from kestrel.kernels.triton.pdl import device_index, hopper_or_later, pdl_enabled

log = logging.getLogger(__name__)
PREFETCH = 8        # keys a slot reads before the PDL wait (groups up to 4): 128 a program of 8 warps, 1,024 a kv
                    # head at 8 programs; halved per doubling of the group past 4, so registers do not spill
DIMS_PER_LANE = 8
MAX_SEQS = 4        # measured at bs1 only; the Triton kernel keeps larger batches, whose grids fill the GPU anyway
CLUSTER = 8         # programs a kv head (a cluster); the kernel also builds for 2, 4 and 16 (non-portable)
SOURCE = Path(__file__).with_name("cluster_decode.cu")


def usable(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, num_seqs: int) -> bool:
    """True when this kernel handles the decode launch: switched on, a Hopper GPU, bf16, a head size that
    splits into 16-byte lane loads, at most 8 query heads a kv head, 16-byte aligned rows, and a small batch."""
    if not switches().cluster_decode or num_seqs > MAX_SEQS or q.device.type != "cuda":
        return False
    if not hopper_or_later(device_index(q.device)):
        return False
    if not (q.dtype == k_cache.dtype == v_cache.dtype == torch.bfloat16):
        return False
    head_dim, group = q.shape[2], q.shape[1] // k_cache.shape[2]
    if head_dim not in (64, 128, 256) or group > 8 or (group * head_dim) % CLUSTER:   # > 8: q and acc spill
        return False
    aligned = all(t.stride(-1) == 1 and all(s % 8 == 0 for s in t.stride()[:-1]) for t in (q, k_cache, v_cache))
    return aligned and _builds(device_index(q.device), group, head_dim, CLUSTER, k_cache.shape[1],
                               mma(group, head_dim), tiles(head_dim))


@functools.lru_cache(maxsize=None)
def _builds(device: int, group: int, head_dim: int, cluster: int, block_size: int, tensor_cores: bool,
            tile_count: int) -> bool:
    """Whether the kernel builds and loads here (once per shape); if not, say why once and keep the Triton
    kernel."""
    try:   # both index widths now, so that no build happens later inside a CUDA-graph capture
        for index64 in (False, True):
            _kernel(device, group, head_dim, cluster, block_size, index64,
                    num_warps(group, head_dim, tensor_cores), tensor_cores, tile_count)
        return True
    except (OSError, RuntimeError) as error:
        log.warning("cluster decode kernel unavailable, decode stays on the Triton kernel: %s", error)
        return False


def mma(group: int, head_dim: int) -> bool:
    """Whether decode runs on the tensor-core build (a warp attends to 16-key tiles with mma.sync), from
    KESTREL_CLUSTER_DECODE_MMA: 1 / 0, or auto (default) = groups of 4 and more. Never at head_dim 256, where a
    tile's K, V and output fragments do not fit in registers. Measured on the H200: the Llama-3.1-8B bs1 step
    (group 4) −2.5% and −2.3%; the Qwen3-0.6B step (group 2) +1.9% and +3.7%, although its kernel alone is
    faster. There decode's exposed time grew 0.8 us a layer while its o_proj (a Triton kernel) started earlier,
    beside decode's smaller programs; that overlap is the suspect, not yet proven."""
    value = switches().cluster_decode_mma
    return head_dim <= 128 and (value == "1" or (value == "auto" and group >= 4))


def tiles(head_dim: int) -> int:
    """16-key tiles a warp holds at a time in the tensor-core build: 2 at head_dim 128 (128 keys a program before
    the wait, as the CUDA-core build's 8 warps), 1 otherwise (at 64, 2 spill)."""
    return 2 if head_dim == 128 else 1


def num_warps(group: int, head_dim: int, tensor_cores: bool = False) -> int:
    """Warps a program: 8 on CUDA cores (16 slots of 16 lanes at head_dim 128, 128 keys read before the wait; on
    the Qwen3-0.6B bs1 step 8 warps measured −0.9% against 4, 2 warps +5.6%), 4 on tensor cores (a warp a slot),
    halved until the slots' partials fit the 48 KB of static shared memory (groups of 8 and more)."""
    warps = 4 if tensor_cores else 8
    while warps > 1 and shared_bytes(warps, group, head_dim, tensor_cores) > 48 * 1024:
        warps //= 2
    return warps


def prefetch(group: int) -> int:
    """Keys a slot holds at a time (read before the wait, then per chunk): PREFETCH, less for groups past 4."""
    return max(2, min(PREFETCH, 32 // group))


def shared_bytes(warps: int, group: int, head_dim: int, tensor_cores: bool = False) -> int:
    """The kernel's static shared memory: each slot's acc, m and l, and the program's (fp32); the tensor-core
    build pads each slot's rows by 8 floats (cluster_decode.cu, ACC_ROW)."""
    slots = warps if tensor_cores else warps * 32 // (head_dim // DIMS_PER_LANE)
    slot_row = head_dim + (8 if tensor_cores else 0)
    return 4 * group * ((slot_row + 2) * slots + head_dim + 2)


def defines(group: int, head_dim: int, cluster: int, block_size: int, index64: bool, warps: int,
            tensor_cores: bool = False, tile_count: int = 2) -> dict[str, int]:
    shape = dict(GROUP=group, HEAD_DIM=head_dim, CLUSTER=cluster, NUM_WARPS=warps, BLOCK_SIZE=block_size,
                 INDEX64=int(index64))
    if tensor_cores:
        return {**shape, "MMA": 1, "TILES": tile_count}
    return {**shape, "PREFETCH": prefetch(group), "DIMS_PER_LANE": DIMS_PER_LANE}


def compile_kernel(group: int, head_dim: int, cluster: int, block_size: int, arch: str = "sm_90",
                   index64: bool = False, warps: int | None = None, tensor_cores: bool | None = None,
                   tile_count: int | None = None) -> cuda_rtc.Compiled:
    """tensor_cores and tile_count default to the engine's choice (mma(group, head_dim), tiles(head_dim))."""
    tensor_cores = mma(group, head_dim) if tensor_cores is None else tensor_cores
    warps = warps or num_warps(group, head_dim, tensor_cores)
    build = defines(group, head_dim, cluster, block_size, index64, warps, tensor_cores,
                    tile_count or tiles(head_dim))
    return cuda_rtc.compile_cubin(SOURCE.read_text(), "cluster_decode", arch, build)


@functools.lru_cache(maxsize=None)
def _kernel(device: int, group: int, head_dim: int, cluster: int, block_size: int,
            index64: bool, warps: int, tensor_cores: bool, tile_count: int) -> cuda_rtc.Kernel:
    compiled = compile_kernel(group, head_dim, cluster, block_size, cuda_rtc.device_arch(device), index64, warps,
                              tensor_cores=tensor_cores, tile_count=tile_count)
    return cuda_rtc.Kernel(compiled, "cluster_decode", torch.device("cuda", device),
                           non_portable_cluster=cluster > 8)


def decode_attention(
    q: torch.Tensor,             # [S, Hq, D] bf16, one query token per sequence
    k_cache: torch.Tensor,       # [num_blocks, block_size, Hkv, D] bf16
    v_cache: torch.Tensor,
    block_table: torch.Tensor,   # [S, max_blocks] int32 or int64 (the graph step's buffers)
    kv_lens: torch.Tensor,       # [S], the block table's dtype, on the device; 0 for padded rows (output 0)
    scale: float,
    cluster: int = CLUSTER,
    tensor_cores: bool | None = None,
) -> torch.Tensor:
    """What paged_decode.decode_attention computes, in one cluster launch with no scratch (usable() must hold).
    cluster: programs a kv head (2, 4, 8 or 16); tensor_cores defaults to the engine's choice (mma())."""
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    index64 = block_table.dtype == torch.int64
    assert block_table.dtype == kv_lens.dtype and block_table.dtype in (torch.int32, torch.int64), \
        f"block table {block_table.dtype} and kv_lens {kv_lens.dtype}: both int32 or both int64"
    group = num_heads // num_kv_heads
    tensor_cores = mma(group, head_dim) if tensor_cores is None else tensor_cores
    warps = num_warps(group, head_dim, tensor_cores)
    kernel = _kernel(device_index(q.device), group, head_dim, cluster, block_size, index64, warps, tensor_cores,
                     tiles(head_dim))
    kernel.launch((num_kv_heads * cluster, num_seqs, 1), warps * 32,
                  launch_args(q, k_cache, v_cache, block_table, kv_lens, out, scale),
                  torch.cuda.current_stream(q.device), cluster=cluster, pdl=pdl_enabled(q.device))
    return out


def launch_args(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                kv_lens: torch.Tensor, out: torch.Tensor, scale: float) -> list:
    """The kernel's arguments in its parameter order (ctypes values)."""
    pointers = [ctypes.c_void_p(t.data_ptr()) for t in (q, k_cache, v_cache, block_table, kv_lens, out)]
    strides = [q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3], block_table.stride(0),
               out.stride(0), out.stride(1)]
    return [*pointers, ctypes.c_float(scale * LOG2E), *[ctypes.c_longlong(s) for s in strides]]
