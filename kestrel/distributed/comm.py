"""TPGroup: one rank's view of its tensor-parallel group, and the collectives the sharded layers call.

Two process groups over the same ranks:

    device_group   NCCL on CUDA, gloo on the CPU: the activations (row-parallel all-reduce, vocab all-gather);
                   on CUDA these run inside the captured graphs
    cpu_group      gloo, always: small host objects (each step's chunks, rank 0 -> the others), agreement on
                   numbers decided per rank (KV blocks), never the activations

With one rank (`SINGLE`) every collective returns its input: the model code is the same with and without TP.
This module imports nothing from kestrel, so the layers can use it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class TPGroup:
    rank: int
    size: int
    device_group: Any = None   # a torch.distributed ProcessGroup, None with one rank
    cpu_group: Any = None
    local_rank: int = 0        # this rank's index on its node: its GPU
    fast_all_reduce: Any = None   # a SymmMemAllReduce (distributed/custom_all_reduce.py) for small CUDA messages

    @property
    def is_driver(self) -> bool:
        """Rank 0 schedules, samples and answers; the other ranks follow it."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over the ranks (row-parallel partial sums), in place."""
        if self.size == 1:
            return x
        if self.fast_all_reduce is not None and self.fast_all_reduce.all_reduce(x) is not None:
            return x
        dist.all_reduce(x, group=self.device_group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] per rank -> [..., size * n], rank r's part at columns [r * n, (r + 1) * n)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.device_group)
        return torch.cat(parts, dim=-1)

    def all_gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """[n, ...] per rank -> [size * n, ...], rank r's rows at [r * n, (r + 1) * n) (a vocab-split table made
        whole)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.device_group)
        return torch.cat(parts, dim=0)

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's obj on every rank (pickled over the CPU group)."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    def broadcast_tensor(self, x: torch.Tensor) -> None:
        """Rank 0's x into every rank's x (same shape), over the device group."""
        if self.size > 1:
            dist.broadcast(x, src=0, group=self.device_group)

    def min_int(self, value: int) -> int:
        """The smallest of the ranks' values: a number every rank must agree on (KV blocks that fit everywhere)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())


SINGLE = TPGroup(rank=0, size=1)
