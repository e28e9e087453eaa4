"""CUDA-event timing for the GPU tests that print kernel times beside their checks."""
from __future__ import annotations

import torch


def time_us(fn, iters: int = 200, warmup: int = 10) -> float:
    """Mean microseconds of fn() over iters launches, after warmup ones (compiles, caches), by CUDA events."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / iters
