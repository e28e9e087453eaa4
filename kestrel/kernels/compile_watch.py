"""Kernel builds after startup: every Triton specialisation a process makes once the engine reported ready.

A Triton kernel is built once per specialisation (its constexprs, its pointer dtypes, and each integer argument's
"divisible by 16" and "equals 1" facts). Startup builds what the graphs, the activation profile and the warm-up
reach; whatever first traffic reaches beyond that is built while requests wait: a compile (0.3-3 s) on a fresh
machine, a disk-cache load (tens of ms) after. Issue 51's "first burst = warm" asks for none, so the engine
counts them: `watch()` chains a hook into `triton.knobs.runtime.jit_cache_hook` (called before every build or
cache load, never on a hit in memory), `mark_ready()` starts the count, and each build after it is logged once as a
warning naming the kernel and its specialisation, so a missed warm-up shape is found by reading the log.

The hook only records: it returns what the previous hook returned (False: build as usual).
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

logger = logging.getLogger("kestrel.compile_watch")


@dataclass(frozen=True)
class Build:
    kernel: str            # module.qualname
    signature: str         # Triton's repr: the options and each argument's type and specialisation
    at_s: float            # monotonic seconds


_LOCK = threading.Lock()
_BUILDS: list[Build] = []        # every build this process made since the hook went in
_READY: list[float] = []         # the ready times of the watches that were marked
_INSTALLED = False


@dataclass
class CompileWatch:
    """One engine's view of the process's builds: those after its own ready."""
    ready_at: float | None = None

    def mark_ready(self) -> None:
        self.ready_at = time.monotonic()
        with _LOCK:
            _READY.append(self.ready_at)

    def after_ready(self) -> list[Build]:
        if self.ready_at is None:
            return []
        with _LOCK:
            return [b for b in _BUILDS if b.at_s >= self.ready_at]


def _record(kernel: str, signature: str) -> None:
    build = Build(kernel, signature, time.monotonic())
    with _LOCK:
        _BUILDS.append(build)
        after_ready = bool(_READY)
    if after_ready:
        logger.warning("kernel built after ready (first traffic waits for it): %s %s", kernel, signature[:400])


def watch() -> CompileWatch:
    """A new engine's watch; the process's hook goes in on the first call (nothing to hook without Triton)."""
    global _INSTALLED
    with _LOCK:
        install, _INSTALLED = not _INSTALLED, True
    if install:
        _install_hook()
    return CompileWatch()


def _install_hook() -> None:
    try:
        import triton
    except ImportError:   # CPU installs without Triton build no kernels
        return
    previous = triton.knobs.runtime.jit_cache_hook

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):   # noqa: A002 - Triton's names
        _record(f"{fn.module}.{fn.name}", repr)
        if previous is not None:
            return previous(key=key, repr=repr, fn=fn, compile=compile, is_manual_warmup=is_manual_warmup,
                            already_compiled=already_compiled)
        return False

    triton.knobs.runtime.jit_cache_hook = hook
