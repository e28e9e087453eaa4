"""Programmatic dependent launch (PDL, Hopper and later) for the decode step's Triton kernels.

A batch-1 decode step is ~200 kernels of 2-6 us each, and in each one a micro-second or two goes to the launch
and the first DRAM round trip while the GPU idles. A kernel launched with PDL (`launch_pdl=True`) may start as soon
as every program of the kernel before it has signalled; it reads what cannot depend on that kernel (its weights),
then waits in `griddepcontrol.wait` until the kernel before it has finished and its writes are visible:

    kernel A  |== wait ==|------------- compute -------------|
    kernel B              |prefetch weights| wait ...........|-- compute --|
                          ^ A signalled (launch_dependents, right after A's own wait)

Rules for a kernel launched with PDL (all kernels here follow them; `pdl_wait` does both steps):
  - before pdl_wait: read only what no kernel of this step writes (weights, norm weights); write nothing (the
    buffer this kernel writes may still be read by the kernel before it, e.g. memory the allocator reused)
  - pdl_wait, then signal dependents: the next kernel starts only once this one's inputs are ready, so at most
    one kernel waits ahead and no chain of waiting kernels holds the SMs.
Kernels launched without PDL (cuBLAS, torch ops, memcpys) keep ordinary stream order on both sides. Stream capture
turns PDL launches into programmatic edges of the CUDA graph. KESTREL_PDL=0 turns it off (kestrel/envs.py: the
A/B against launches in plain stream order).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kestrel.envs import switches


def pdl_enabled(device: torch.device) -> bool:
    """PDL on a CUDA device of compute capability >= 9.0, unless KESTREL_PDL=0 or under Triton's interpreter."""
    if not switches().pdl or device.type != "cuda" or triton.knobs.runtime.interpret:
        return False
    return hopper_or_later(device_index(device))


def device_index(device: torch.device) -> int:
    """The CUDA device's index ("cuda" alone means the current device)."""
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def hopper_or_later(device_index: int) -> bool:
    """Compute capability >= 9.0: PDL, thread-block clusters (kestrel/kernels/cuda/cluster_decode.py)."""
    return torch.cuda.get_device_capability(device_index)[0] >= 9


@functools.lru_cache(maxsize=None)
def sm_count(device_index: int) -> int:
    """Streaming multiprocessors of the device (grids are sized to fill them)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def launch_options(device: torch.device) -> dict[str, bool]:
    """Extra kernel-launch keywords (merged into `kernel[grid](..., **launch_options(dev))`) and the USE_PDL
    constexpr that makes the kernel call pdl_wait."""
    on = pdl_enabled(device)
    return {"launch_pdl": True, "USE_PDL": True} if on else {"USE_PDL": False}


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """Wait for the kernel before this one to finish (its writes visible), then let the next kernel launch."""
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
