"""Linear layers that know their tensor-parallel shard from day one (one rank for now).

Every parameter carries a `weight_loader(param, loaded[, shard_id])` that copies its slice of a checkpoint
tensor; with tp_size == 1 the slice is the whole tensor. QKV and gate/up are merged at load so one GEMM serves
several checkpoint tensors:

    qkv_proj.weight: [(num_heads + 2 * num_kv_heads) * head_dim, hidden]   rows: q | k | v
    gate_up_proj.weight: [2 * intermediate, hidden]                         rows: gate | up
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kestrel.errors import ModelLoadError


def _copy_checked(param: torch.Tensor, loaded: torch.Tensor, what: str) -> None:
    if param.shape != loaded.shape:
        raise ModelLoadError(f"tensor {what}: checkpoint shape {tuple(loaded.shape)} does not match the "
                             f"expected {tuple(param.shape)}")
    param.data.copy_(loaded)


class LinearBase(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, tp_dim: int | None,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.tp_rank, self.tp_size, self.tp_dim = tp_rank, tp_size, tp_dim
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def _shard(self, loaded: torch.Tensor, dim: int) -> torch.Tensor:
        if self.tp_size == 1:
            return loaded
        size = loaded.shape[dim] // self.tp_size
        return loaded.narrow(dim, self.tp_rank * size, size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, name: str = "?") -> None:
        if self.tp_dim is not None and (param.dim() > 1 or self.tp_dim == 0):
            loaded = self._shard(loaded, self.tp_dim if param.dim() > 1 else 0)
        _copy_checked(param, loaded, name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp_rank: int = 0,
                 tp_size: int = 1) -> None:
        super().__init__(in_features, out_features // tp_size, bias, 0, tp_rank, tp_size)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; the partial sums would be all-reduced (one rank: nothing to do)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp_rank: int = 0,
                 tp_size: int = 1) -> None:
        super().__init__(in_features // tp_size, out_features, bias, 1, tp_rank, tp_size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, name: str = "?") -> None:
        if param.dim() > 1:
            loaded = self._shard(loaded, 1)
        _copy_checked(param, loaded, name)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs stacked in one weight (gate | up)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False, tp_rank: int = 0,
                 tp_size: int = 1) -> None:
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias, tp_rank, tp_size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, name: str = "?",
                      shard_id: int = 0) -> None:
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        _copy_checked(param.data.narrow(0, offset, size), self._shard(loaded, 0), name)


class QKVParallelLinear(ColumnParallelLinear):
    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        self.head_dim = head_dim
        self.num_heads = num_heads // tp_size
        self.num_kv_heads = max(1, num_kv_heads // tp_size)
        out = (num_heads + 2 * num_kv_heads) * head_dim
        super().__init__(hidden_size, out, bias, tp_rank, tp_size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, name: str = "?",
                      shard_id: str = "q") -> None:
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[shard_id]
        _copy_checked(param.data.narrow(0, offset, size), self._shard(loaded, 0), name)
