"""The matmul after decode attention with its weight already in shared memory (resident_gemv.cu). Hopper, bf16,
one row.

On the Llama-3.1-8B bs1 step the layer's HBM idles for ~8 us while the attention prologue and decode run (their
K/V are ~1.5 MB a layer), then o_proj streams its 33.6 MB in ~10 us (BENCHMARKS.md session 12). This kernel,
launched with PDL as soon as attention has passed its wait, bulk-copies most of o_proj's weight into shared
memory (one block an SM, ~184 KB each) and prefetches the rest into L2 before its own wait, so that after it only
x is read and the dot products run from shared memory.

For a block to be resident beside a cluster decode program, that kernel asks for the SM's whole shared-memory
carveout (cluster_decode.py) and this one stays under 80 registers a thread (4 warps). `usable` says whether a
weight qualifies; KESTREL_RESIDENT_GEMV (models/llama.py's skinny path, engine/fast_path.py) switches it on.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from kestrel import cuda_rtc
from kestrel.layers.pdl import device_index, hopper_or_later, pdl_enabled, sm_count

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("resident_gemv.cu")
WARPS = 4
MIN_BLOCKS = 6              # __launch_bounds__(128, 6): <= 85 registers, so 80 (a block: 10,240 of the 10,240
                            # a group-4 cluster decode program (216 x 256) leaves free on its SM)
# Shared memory a block may take: an H200 SM has 228 KB; a cluster decode program (group 4, 8 warps) takes 34.5 KB
# and each block 1 KB of reserve. What is left holds x (2 K bytes) and as much of ROWS weight rows as fits.
SHARED_BUDGET = 188 * 1024


@dataclass(frozen=True)
class ResidentConfig:
    rows: int               # output rows a block (a multiple of WARPS)
    smem_k: int             # elements of each row copied into shared memory before the wait (a multiple of 256)
    prefetch_l2: bool = True

    def shared_bytes(self, k: int) -> int:
        return 2 * (self.rows * self.smem_k + k)


def config_for(n: int, k: int, sms: int, budget: int = SHARED_BUDGET, prefetch_l2: bool = True
               ) -> ResidentConfig | None:
    """Rows a block such that the grid is one wave of one block an SM, then the widest staged part of each row
    that fits `budget`; None when the part left to stream would not fit in the staged part's space."""
    rows = WARPS * math.ceil(n / (sms * WARPS))
    per_row = (budget - 2 * k) // (2 * rows)
    smem_k = min(k, per_row // 256 * 256)
    if smem_k <= 0 or k - smem_k > smem_k:
        return None
    return ResidentConfig(rows=rows, smem_k=smem_k, prefetch_l2=prefetch_l2)


def enabled() -> bool:
    """KESTREL_RESIDENT_GEMV=1 switches the kernel on for the matmul after decode attention (A/B: off by
    default until measured)."""
    return os.environ.get("KESTREL_RESIDENT_GEMV", "0") == "1"


def max_shared_carveout(kernel: str) -> bool:
    """Whether `kernel` ("decode", "gemv", "resident") asks for the SM's whole shared-memory carveout.
    KESTREL_SHARED_CARVEOUT (A/B): unset = the decode kernel and this one when this one is on; "all" = every
    CUDA C++ kernel of the step (no SM ever switches its split between them); "none"; or a kernel name."""
    mode = os.environ.get("KESTREL_SHARED_CARVEOUT")
    if mode is None:
        return enabled() and kernel in ("decode", "resident")
    return mode == "all" or mode == kernel


def budget() -> int:
    kb = os.environ.get("KESTREL_RESIDENT_GEMV_KB")
    return int(kb) * 1024 if kb else SHARED_BUDGET


def usable(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether this kernel serves x @ w.T here: one row, bf16, Hopper, K a multiple of 256, 16-byte aligned rows,
    a config that fits, and the kernel builds."""
    if x.device.type != "cuda" or x.dim() != 2 or x.shape[0] != 1:
        return False
    if not (x.dtype == w.dtype == torch.bfloat16) or not hopper_or_later(device_index(x.device)):
        return False
    n, k = w.shape
    if k % 256 or x.shape[1] != k:
        return False
    aligned = all(t.stride(-1) == 1 and t.stride(0) % 8 == 0 and t.data_ptr() % 16 == 0 for t in (x, w))
    device = device_index(x.device)
    return aligned and _config(device, n, k) is not None and _builds(device, n, k)


@functools.lru_cache(maxsize=None)
def _config(device: int, n: int, k: int) -> ResidentConfig | None:
    return config_for(n, k, sm_count(device), budget(), os.environ.get("KESTREL_RESIDENT_GEMV_L2", "1") == "1")


@functools.lru_cache(maxsize=None)
def _builds(device: int, n: int, k: int) -> bool:
    try:
        _kernel(device, k, _config(device, n, k))
        return True
    except (OSError, RuntimeError) as error:
        log.warning("resident o_proj kernel unavailable, the matmul stays on the other paths: %s", error)
        return False


def compile_kernel(k: int, config: ResidentConfig, arch: str = "sm_90") -> cuda_rtc.Compiled:
    defines = dict(K=k, ROWS=config.rows, WARPS=WARPS, SMEM_K=config.smem_k, MIN_BLOCKS=MIN_BLOCKS,
                   PREFETCH_L2=int(config.prefetch_l2))
    return cuda_rtc.compile_cubin(SOURCE.read_text(), "resident_gemv", arch, defines)


@functools.lru_cache(maxsize=None)
def _kernel(device: int, k: int, config: ResidentConfig) -> cuda_rtc.Kernel:
    compiled = compile_kernel(k, config, cuda_rtc.device_arch(device))
    return cuda_rtc.Kernel(compiled, "resident_gemv", torch.device("cuda", device),
                           dynamic_shared=config.shared_bytes(k), max_shared_carveout=max_shared_carveout("resident"))


def gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
         config: ResidentConfig | None = None) -> torch.Tensor:
    """gemv_ref at one row: x [1, K] @ w [N, K].T (+ bias) -> [1, N]."""
    n, k = w.shape
    assert x.shape == (1, k) and x.dtype == w.dtype == torch.bfloat16, f"x {tuple(x.shape)}, w {tuple(w.shape)}"
    if bias is not None:
        assert bias.shape == (n,) and bias.dtype == x.dtype and bias.stride(0) == 1
    device = device_index(x.device)
    cfg = config or _config(device, n, k)
    assert cfg is not None, f"no resident config for {n}x{k}"
    kernel = _kernel(device, k, cfg)
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    ptr = lambda t: ctypes.c_void_p(t.data_ptr() if t is not None else 0)   # noqa: E731
    args = [ptr(x), ptr(w), ctypes.c_longlong(w.stride(0)), ptr(bias), ptr(out), ctypes.c_int(n)]
    kernel.launch((math.ceil(n / cfg.rows), 1, 1), WARPS * 32, args, torch.cuda.current_stream(x.device),
                  pdl=pdl_enabled(x.device))
    return out
