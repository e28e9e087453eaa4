"""Asking the next matmuls' weights into L2 while the step is busy with something else (experiment, Hopper).

At batch 1 a decode layer of Qwen3-0.6B reads 31.5 MB of weights (~7.4 us at HBM bandwidth) in a ~25 us layer:
HBM idles through the attention prologue, decode attention and every kernel boundary, and each skinny matmul
then streams its own weights on the critical path (reading the whole slice before the PDL wait took 10% off the
step: weight arrival decides). Here a skinny matmul, before its PDL wait, also asks the L2 cache to fetch the
weights of the matmuls that come after it, so they read from L2 (50 MB on the H200) instead of HBM:

    qkv_proj     also fetches  o_proj + gate_up_proj      (16.8 MB for the 0.6B; prologue + attention run meanwhile)
    o_proj                     down_proj
    gate_up_proj               the next layer's qkv_proj
    down_proj                  nothing

Each program takes an equal share of each region and each of its SLOTS lanes one chunk of that share, with one
`cp.async.bulk.prefetch.L2.global` (sm_90; a hint: no register, no wait, no result):

    region bytes  [ program 0 share | program 1 share | ... ]      share = cdiv(bytes, programs), 16-byte multiple
    one share     [ lane 0 | lane 1 | ... | lane SLOTS-1 ]          chunk = cdiv(share, SLOTS), 16-byte multiple

Where qkv_proj runs on cuBLAS (the 8B: every matmul there is above the skinny policy's cap), no Triton matmul
precedes o_proj, so a small kernel of its own, launched just before the attention prologue, asks for o_proj's
first MAX_PREFETCH_BYTES while the prologue and decode attention (~9 us, light on HBM) run:

    8B layer:  norm | qkv (cuBLAS) | prefetch o_proj | prologue | decode | o_proj (cuBLAS, partly from L2) | ...

Results cannot change: nothing is written. KESTREL_L2_PREFETCH=1 turns it on; off until an H200 A/B
(scripts/gpu_suite.sh).
"""
from __future__ import annotations

import os
from typing import Callable

import torch
import triton
import triton.language as tl

from kestrel.layers.pdl import compiled_for_hopper, launch_options, pdl_wait

SLOTS = 128                  # prefetches per program per region: one per thread of a 4-warp program
MAX_REGIONS = 2              # regions one kernel may prefetch (qkv_proj fetches two weights)
MAX_PREFETCH_BYTES = 24 << 20   # per kernel: with the weights being read, stays well inside the 50 MB L2

PREFETCH_ASM = tl.constexpr("""{
.reg .pred p;
setp.gt.s32 p, $2, 0;
@p cp.async.bulk.prefetch.L2.global [$1], $2;
mov.u32 $0, 0;
}""")


@triton.jit
def prefetch_chunks(nbytes, pid, num_programs, SLOTS: tl.constexpr):
    """Byte offsets and sizes [SLOTS] of program pid's chunks of a region of nbytes: the programs' chunks tile
    [0, nbytes // 16 * 16) without overlap; sizes are 16-byte multiples, 0 for lanes with nothing to fetch."""
    share = tl.cdiv(tl.cdiv(nbytes, num_programs), 16) * 16
    chunk = tl.cdiv(tl.cdiv(share, SLOTS), 16) * 16
    lo = pid.to(tl.int64) * share
    start = lo + tl.arange(0, SLOTS).to(tl.int64) * chunk
    end = tl.minimum(lo + share, nbytes // 16 * 16)
    size = tl.minimum(tl.maximum(end - start, 0), chunk)
    return start, size.to(tl.int32)


@triton.jit
def l2_prefetch(ptr, nbytes, SLOTS: tl.constexpr):
    """This program's share of the nbytes at ptr (16-byte aligned), asked into L2; returns at once."""
    start, size = prefetch_chunks(nbytes, tl.program_id(0), tl.num_programs(0), SLOTS)
    tl.inline_asm_elementwise(PREFETCH_ASM, "=r,l,r", [ptr.to(tl.pointer_type(tl.int8)) + start, size],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_kernel(ptr, nbytes, SLOTS: tl.constexpr, USE_PDL: tl.constexpr):
    l2_prefetch(ptr, nbytes, SLOTS)   # before the wait: the weights are no kernel's output
    pdl_wait(USE_PDL)


PREFETCH_PROGRAMS = 64   # a few hundred bytes to a few KB per lane for tens of MB


def prefetch_into_l2(tensors: tuple[torch.Tensor, ...]) -> None:
    """Launch the standalone prefetch for each tensor's first MAX_PREFETCH_BYTES (no-op where it is off)."""
    if not tensors or not l2_prefetch_enabled(tensors[0].device):
        return
    for t in tensors:
        (ptr, nbytes, _, _), _ = prefetch_args((t,), t)   # checks contiguity and alignment
        _prefetch_kernel[(PREFETCH_PROGRAMS,)](ptr, min(nbytes, MAX_PREFETCH_BYTES), SLOTS=SLOTS,
                                               **launch_options(t.device))


def l2_prefetch_enabled(device: torch.device) -> bool:
    """KESTREL_L2_PREFETCH=1 on Hopper or later (bulk prefetch is sm_90), never under the interpreter."""
    return os.environ.get("KESTREL_L2_PREFETCH", "0") == "1" and compiled_for_hopper(device)


def prefetch_args(regions: tuple[torch.Tensor, ...], fallback: torch.Tensor) -> tuple[list, int]:
    """Kernel arguments (ptr_a, bytes_a, ptr_b, bytes_b) and the region count for up to MAX_REGIONS tensors;
    unused slots point at `fallback` with 0 bytes."""
    assert len(regions) <= MAX_REGIONS, f"at most {MAX_REGIONS} prefetch regions, got {len(regions)}"
    args: list = []
    for i in range(MAX_REGIONS):
        if i < len(regions):
            t = regions[i]
            assert t.is_contiguous() and t.data_ptr() % 16 == 0, "prefetch regions: contiguous, 16-byte aligned"
            args += [t, t.numel() * t.element_size()]
        else:
            args += [fallback, 0]
    return args, len(regions)


def plan_layer_prefetches(layers, use_triton: Callable[[int, int, int], bool]) -> None:
    """Sets each decoder layer's `l2_prefetch` {matmul name or "attention": weights to fetch} in step order
    (tables above); use_triton is the skinny policy (rows, out, in), asked for one row. Regions beyond
    MAX_PREFETCH_BYTES per kernel are left out of the matmuls' plans; the standalone launch takes a prefix."""
    def capped(*weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
        kept, total = [], 0
        for w in weights:
            size = w.numel() * w.element_size()
            if total + size <= MAX_PREFETCH_BYTES:
                kept.append(w)
                total += size
        return tuple(kept)

    layers = list(layers)
    for i, layer in enumerate(layers):
        attn, mlp = layer.self_attn, layer.mlp
        after = layers[i + 1].self_attn.qkv_proj.weight if i + 1 < len(layers) else None
        layer.l2_prefetch = {
            "qkv": capped(attn.o_proj.weight, mlp.gate_up_proj.weight),
            "o": capped(mlp.down_proj.weight),
            "gate_up": capped(after) if after is not None else (),
            "down": (),
            # no Triton qkv kernel to issue o_proj's prefetch: a launch of its own before attention does
            "attention": () if use_triton(1, *attn.qkv_proj.weight.shape) else (attn.o_proj.weight,),
        }
