"""The symmetric-memory all-reduce's routing (which collective a message takes) and its CPU behaviour; the kernels
themselves need two GPUs (tests/gpu/test_tp_multi_gpu.py)."""
from __future__ import annotations

import pytest
import torch

from kestrel.config import EngineConfig
from kestrel.distributed.custom_all_reduce import (DEFAULT_MAX_BYTES, ONE_SHOT_MAX_BYTES, SymmMemAllReduce,
                                                   route_for)


@pytest.mark.parametrize("numel, dtype, kind", [
    (4096, torch.bfloat16, "one_shot"),                       # 8B decode at bs1: 8 KB
    (ONE_SHOT_MAX_BYTES // 2, torch.bfloat16, "one_shot"),    # the boundary belongs to one-shot
    (ONE_SHOT_MAX_BYTES // 2 + 8, torch.bfloat16, "two_shot"),
    (128 * 4096, torch.bfloat16, "two_shot"),                 # 8B decode at 128 concurrent: 1 MiB
    (DEFAULT_MAX_BYTES // 2 + 8, torch.bfloat16, "nccl"),     # past the buffer
    (4096, torch.float32, "one_shot"),
    (4096, torch.int64, "nccl"),
    (4095, torch.bfloat16, "nccl"),                           # not whole 16-byte vectors
])
def test_route_follows_size_and_dtype(numel, dtype, kind):
    assert route_for(numel, dtype, world_size=2, max_bytes=DEFAULT_MAX_BYTES).kind == kind


def test_two_shot_needs_slices_that_split_over_the_ranks():
    numel = ONE_SHOT_MAX_BYTES // 2 + 8                       # whole 16-byte vectors: 4 ranks split it, 6 do not
    assert route_for(numel, torch.bfloat16, world_size=4, max_bytes=DEFAULT_MAX_BYTES).kind == "two_shot"
    route = route_for(numel, torch.bfloat16, world_size=6, max_bytes=DEFAULT_MAX_BYTES)
    assert route.kind == "nccl" and "split" in route.reason


def test_every_rank_picks_the_same_route_for_every_decode_and_prefill_shape():
    """The choice depends on the message alone: ranks holding the same-shaped partial sums never diverge."""
    for tokens in (1, 2, 7, 64, 128, 256, 2048):
        for hidden in (576, 896, 4096, 7168):
            routes = {route_for(tokens * hidden, torch.bfloat16, 4, DEFAULT_MAX_BYTES) for _ in range(4)}
            assert len(routes) == 1


def test_cpu_groups_never_open_it():
    assert SymmMemAllReduce.open(None, 2, torch.device("cpu")) is None


def test_flag_reaches_the_config():
    import argparse
    from kestrel.config import add_engine_args   # the serve/generate flags
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert EngineConfig.from_args(parser.parse_args(["--disable-custom-all-reduce"])).disable_custom_all_reduce
    assert not EngineConfig().disable_custom_all_reduce
