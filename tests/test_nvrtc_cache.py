"""NVRTC builds are kept on disk (kestrel/kernels/cuda/cuda_rtc.py compile_cubin), as Triton keeps its kernels: a
second build of the same source, defines and architecture is read back, one with other defines is compiled, and a
corrupt cache file is compiled over."""
from __future__ import annotations

import pytest

from kestrel.kernels.cuda import cuda_rtc

pytestmark = pytest.mark.skipif(not cuda_rtc.nvrtc_available(), reason="NVRTC (nvidia-cuda-nvrtc) not installed")
SOURCE = "extern \"C\" __global__ void add_one(float* x) { x[threadIdx.x] += VALUE; }"


def test_a_second_build_is_read_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = cuda_rtc.compile_cubin(SOURCE, "add_one", "sm_90", {"VALUE": 1})
    assert len(list(cuda_rtc.cache_dir().glob("add_one-*.pkl"))) == 1
    compiles = []
    real = cuda_rtc._compile
    monkeypatch.setattr(cuda_rtc, "_compile", lambda *a: compiles.append(a) or real(*a))
    again = cuda_rtc.compile_cubin(SOURCE, "add_one", "sm_90", {"VALUE": 1})
    assert again == first and compiles == []
    other = cuda_rtc.compile_cubin(SOURCE, "add_one", "sm_90", {"VALUE": 2})
    assert len(compiles) == 1 and other.cubin != first.cubin
    for path in cuda_rtc.cache_dir().glob("add_one-*.pkl"):
        path.write_bytes(b"not a pickle")
    assert cuda_rtc.compile_cubin(SOURCE, "add_one", "sm_90", {"VALUE": 1}).cubin == first.cubin and len(compiles) == 2
