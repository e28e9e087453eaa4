"""Developer switches: the one place Kestrel reads the environment, once, into a frozen dataclass.

Everything a user sets is a flag and the same-named `LLM(...)` keyword (config.py). What is left here are
switches for kernel A/B runs and debugging: each one turns a fast path off so it can be compared with the
path it replaced. They are read the first time `switches()` is called (at engine start) and never again;
tests that change one call `switches.cache_clear()`.

    KESTREL_FUSED_OPS=0          torch ops instead of the fused Triton/CUDA kernels on CUDA (the reference path)
    KESTREL_SKINNY_MATMUL=auto   decode-sized matmuls: auto (measured per shape), 0 (cuBLAS), all (Triton)
    KESTREL_CUDA_GEMV=auto       CUDA C++ one-row matmuls for large weights: auto, 0 (off), all (every weight)
    KESTREL_PDL=1                programmatic dependent launch between decode kernels on Hopper
    KESTREL_CLUSTER_DECODE=1     the thread-block-cluster decode attention kernel for small bf16 batches on Hopper
    KESTREL_CLUSTER_DECODE_MMA=auto   its tensor-core build: auto (groups of 4 and more), 0, 1
    KESTREL_FUSED_MOE=1          0: the torch experts instead of the fused Triton MoE kernels (kernels/triton/fused_moe.py)
    KESTREL_FP8_BLOCK_GEMM=w8a8  FP8 tile-scaled matmuls above 16 rows: w8a8 (activations quantized in the kernel,
                                 FP8 tensor cores), w8a16 (FP8 weights widened to bf16 in registers, as before)
    KESTREL_FP8_MOE=w8a16        block-FP8 experts in the fused MoE kernels: w8a16 (FP8 tiles widened to x's dtype),
                                 w8a8 (activations quantized per token x 128 group in the K loop, FP8 tensor cores,
                                 Hopper+). Default w8a16 until a GPU measures W8A8 faster
                                 (tests/gpu/test_moe_fp8_gpu.py prints both beside bf16)
    CUDA_HOME=/usr/local/cuda    where NVRTC's headers are looked for
    XDG_CACHE_HOME=~/.cache      where NVRTC's cubins are kept between runs (kestrel/nvrtc), beside other tools'
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path


def omp_threads_set() -> bool:
    """Whether the user chose the intra-op thread count (OpenMP's own variable, which torch honours)."""
    return "OMP_NUM_THREADS" in os.environ


def cache_home() -> Path:
    """The user's cache directory (the XDG convention Triton and pip follow too); read at each call, so a process
    that points it elsewhere (a cold-start benchmark, a test) is obeyed."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")


def _choice(name: str, default: str, allowed: tuple[str, ...]) -> str:
    value = os.environ.get(name, default).strip() or default
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is invalid: expected one of {', '.join(allowed)}")
    return value


def _flag(name: str, default: bool) -> bool:
    return _choice(name, "1" if default else "0", ("0", "1")) == "1"


@dataclass(frozen=True, slots=True)
class DevSwitches:
    fused_ops: bool = True
    skinny_matmul: str = "auto"
    cuda_gemv: str = "auto"
    pdl: bool = True
    cluster_decode: bool = True
    cluster_decode_mma: str = "auto"
    fused_moe: bool = True
    fp8_block_gemm: str = "w8a8"
    fp8_moe: str = "w8a16"
    cuda_home: str = "/usr/local/cuda"


@functools.cache
def switches() -> DevSwitches:
    return DevSwitches(
        fused_ops=_flag("KESTREL_FUSED_OPS", True),
        skinny_matmul=_choice("KESTREL_SKINNY_MATMUL", "auto", ("auto", "0", "all")),
        cuda_gemv=_choice("KESTREL_CUDA_GEMV", "auto", ("auto", "0", "all")),
        pdl=_flag("KESTREL_PDL", True),
        cluster_decode=_flag("KESTREL_CLUSTER_DECODE", True),
        cluster_decode_mma=_choice("KESTREL_CLUSTER_DECODE_MMA", "auto", ("auto", "0", "1")),
        fused_moe=_flag("KESTREL_FUSED_MOE", True),
        fp8_block_gemm=_choice("KESTREL_FP8_BLOCK_GEMM", "w8a8", ("w8a8", "w8a16")),
        fp8_moe=_choice("KESTREL_FP8_MOE", "w8a16", ("w8a16", "w8a8")),
        cuda_home=os.environ.get("CUDA_HOME", "/usr/local/cuda"),
    )


def disable_nccl_nvls() -> None:
    """Before NCCL starts (tensor parallelism): NVLink SHARP multicast off. It takes device memory per
    communicator and has hung collectives on some drivers; Kestrel's all-reduces are small and gain nothing."""
    os.environ["NCCL_NVLS_ENABLE"] = "0"


def child_environment(**extra: str) -> dict[str, str]:
    """This process's environment plus `extra`, for a child process (kestrel launch)."""
    return {**os.environ, **extra}
