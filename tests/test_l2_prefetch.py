"""The L2 prefetch experiment (kestrel/layers/l2_prefetch.py) without a GPU: the chunk arithmetic under Triton's
interpreter, and the skinny matmul compiled for sm_90 (Triton's bundled ptxas, no device) to show the bulk
prefetches are emitted, and before the PDL wait. Numerics cannot change (nothing is written); tests/gpu holds the
on-device check that results stay bit-identical."""
from __future__ import annotations

import re

import pytest
import torch
import triton
import triton.language as tl

from kestrel.layers.l2_prefetch import SLOTS, prefetch_chunks
from tests.sm90 import compile_for_sm90
from tests.triton_interpreter import INTERPRETED, interpreted_only, run_file_under_interpreter

interpreted = interpreted_only("test_l2_prefetch_under_triton_interpreter")


@triton.jit
def chunks_kernel(starts_ptr, sizes_ptr, nbytes, SLOTS: tl.constexpr):
    """Each program's lanes' (start, size) from prefetch_chunks, stored for the host to check."""
    pid = tl.program_id(0)
    start, size = prefetch_chunks(nbytes, pid, tl.num_programs(0), SLOTS)
    lanes = pid * SLOTS + tl.arange(0, SLOTS)
    tl.store(starts_ptr + lanes, start)
    tl.store(sizes_ptr + lanes, size)


@pytest.mark.skipif(INTERPRETED, reason="this is the interpreter child")
def test_l2_prefetch_under_triton_interpreter():
    run_file_under_interpreter(__file__)


@interpreted
@pytest.mark.parametrize("nbytes,programs", [(4_194_304, 128), (12_582_912, 256), (1_000_003, 7), (48, 5),
                                             (16, 3), (8, 2)])
def test_chunks_tile_the_region_once_in_aligned_pieces(nbytes, programs):
    starts = torch.zeros(programs * SLOTS, dtype=torch.int64)
    sizes = torch.zeros(programs * SLOTS, dtype=torch.int32)
    chunks_kernel[(programs,)](starts, sizes, nbytes, SLOTS=SLOTS)
    used = sizes > 0
    assert bool((sizes % 16 == 0).all()) and bool((starts[used] % 16 == 0).all())
    covered = sorted(zip(starts[used].tolist(), sizes[used].tolist()))
    edge = 0
    for start, size in covered:   # contiguous, no overlap, in order
        assert start == edge, f"gap or overlap at byte {edge}: next chunk starts at {start}"
        edge = start + size
    assert edge == nbytes // 16 * 16


def _compile_skinny_for_sm90(regions: int) -> str:
    """PTX of the bf16 skinny matmul (add-RMSNorm prologue, whole 1024-wide slice, PDL) built for an H100/H200."""
    from kestrel.layers.gemv import PROLOGUE_RMS, _skinny_matmul_kernel
    constexprs = dict(K=1024, PROLOGUE=PROLOGUE_RMS.value, HAS_RES=True, HAS_BIAS=False, BLOCK_M=1, BLOCK_N=16,
                      BLOCK_K=1024, USE_DOT=False, FOLD=1, UNROLL=True, DOT_FP32=False, DOT_PRECISION="tf32",
                      PREFETCH_REGIONS=regions, USE_PDL=True)
    return compile_for_sm90(_skinny_matmul_kernel, constexprs, {"eps": "fp32"})


@pytest.mark.skipif(INTERPRETED, reason="compiles for sm_90; the interpreter child runs the chunk test")
@pytest.mark.parametrize("regions", [0, 1, 2])
def test_skinny_matmul_for_sm90_asks_l2_for_each_region_before_the_pdl_wait(regions):
    ptx = _compile_skinny_for_sm90(regions)
    lines = ptx.splitlines()
    prefetches = [i for i, line in enumerate(lines) if "cp.async.bulk.prefetch.L2.global" in line]
    waits = [i for i, line in enumerate(lines) if re.search(r"griddepcontrol\.wait", line)]
    assert waits, "the PDL wait is missing"
    assert len(prefetches) == regions
    assert all(i < waits[0] for i in prefetches), "a prefetch comes after the PDL wait"


@pytest.mark.skipif(INTERPRETED, reason="compiles for sm_90; the interpreter child runs the chunk test")
def test_standalone_prefetch_kernel_for_sm90_asks_l2_then_waits():
    from kestrel.layers.l2_prefetch import _prefetch_kernel
    lines = compile_for_sm90(_prefetch_kernel, {"SLOTS": SLOTS, "USE_PDL": True},
                             {"ptr": "*bf16", "nbytes": "i64"}).splitlines()
    prefetches = [i for i, line in enumerate(lines) if "cp.async.bulk.prefetch.L2.global" in line]
    waits = [i for i, line in enumerate(lines) if "griddepcontrol.wait" in line]
    assert len(prefetches) == 1 and waits and prefetches[0] < waits[0]


def test_prefetch_is_off_without_the_switch_or_a_hopper_gpu(monkeypatch):
    from kestrel.layers.l2_prefetch import l2_prefetch_enabled
    monkeypatch.setenv("KESTREL_L2_PREFETCH", "1")
    assert not l2_prefetch_enabled(torch.device("cpu"))
    monkeypatch.setenv("KESTREL_L2_PREFETCH", "0")
    assert not l2_prefetch_enabled(torch.device("cpu"))


def test_prefetch_args_pad_unused_regions_and_refuse_too_many():
    from kestrel.layers.l2_prefetch import prefetch_args
    w, a = torch.zeros(4, 8, dtype=torch.bfloat16), torch.zeros(16, dtype=torch.float32)
    args, regions = prefetch_args((a,), w)
    assert regions == 1 and args[0] is a and args[1] == 64 and args[2] is w and args[3] == 0
    with pytest.raises(AssertionError, match="at most 2"):
        prefetch_args((a, a, a), w)
