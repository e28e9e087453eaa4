"""kernels/compile_watch.py: the Triton builds a process makes after an engine reported ready are counted and logged
(issue 51: first traffic must not wait for kernel builds). Without a GPU Triton's JIT never builds, so the hook is
called here the way triton/runtime/jit.py's _call_hook calls it (keyword arguments, a JitFunctionInfo); the GPU
suite (tests/gpu/test_first_traffic_gpu.py) checks the real count after a burst."""
from __future__ import annotations

import logging

import triton
from triton.runtime.jit import JitFunctionInfo

from kestrel.kernels.compile_watch import watch


def _build(name: str) -> object:
    fn = JitFunctionInfo(module="kestrel.kernels.triton.example", name=name, jit_function=None)
    return triton.knobs.runtime.jit_cache_hook(key=("k",), repr=f"{name}[num_warps=4](M: i32D)", fn=fn,
                                               compile={}, is_manual_warmup=False, already_compiled=False)


def test_builds_after_ready_are_counted_and_logged(caplog):
    first = watch()
    assert _build("_startup_kernel") is False   # the hook records; Triton then builds as usual
    assert first.after_ready() == []             # not ready yet: startup's builds do not count
    first.mark_ready()
    second = watch()                             # another engine in the same process, still starting
    with caplog.at_level(logging.WARNING, logger="kestrel.compile_watch"):
        _build("_traffic_kernel")
    assert [b.kernel for b in first.after_ready()] == ["kestrel.kernels.triton.example._traffic_kernel"]
    assert second.after_ready() == []
    assert "kernel built after ready" in caplog.text and "_traffic_kernel" in caplog.text
    assert "M: i32D" in caplog.text              # the specialisation that was missing from the warm-up
