"""Linear layers that know their tensor-parallel shard from day one (one rank for now), and hold their method.

Every call of a linear layer goes through its `method` (a LinearMethod, chosen when the model is built): the plain
matmul, the decode-sized kernels of layers/skinny.py, later FP8, so no path through the model can skip it. A layer
also offers the folds a decoder composes (the norm before it, SiLU-mul on its input or output, the attention
prologue after it); the method decides per call whether one kernel does the fold or the unfused ops run.

Every parameter carries a `weight_loader(param, loaded[, shard_id])` that copies its slice of a checkpoint
tensor; with tp_size == 1 the slice is the whole tensor. QKV and gate/up are merged at load so one GEMM serves
several checkpoint tensors:

    qkv_proj.weight: [(num_heads + 2 * num_kv_heads) * head_dim, hidden]   rows: q | k | v
    gate_up_proj.weight: [2 * intermediate, hidden]                         rows: gate | up
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from kestrel.errors import ModelLoadError

Norm = Callable[..., Any]   # RMSNorm: norm(x) -> y, norm(x, residual) -> (y, x + residual)


def _copy_checked(param: torch.Tensor, loaded: torch.Tensor, what: str) -> None:
    if param.shape != loaded.shape:
        raise ModelLoadError(f"tensor {what}: checkpoint shape {tuple(loaded.shape)} does not match the "
                             f"expected {tuple(param.shape)}")
    param.data.copy_(loaded)


def silu_and_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2 I] (gate | up) -> silu(gate) * up, [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@dataclass(frozen=True, slots=True)
class RopeInputs:
    """What the attention prologue needs when a method folds it into the QKV projection (rotary, K/V write)."""
    positions: torch.Tensor
    cos_sin_cache: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor
    num_heads: int
    num_kv_heads: int
    head_dim: int


class LinearMethod:
    """The plain method: torch ops. Subclasses replace the calls they can do faster and fall back here."""

    def apply(self, layer: "LinearBase", x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)

    def apply_norm(self, layer: "LinearBase", x: torch.Tensor, residual: torch.Tensor | None, norm: Norm
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """(layer(norm(x + residual)), x + residual); residual None means x is the residual stream."""
        if residual is None:
            return self.apply(layer, norm(x)), x
        hidden, residual = norm(x, residual)
        return self.apply(layer, hidden), residual

    def apply_norm_silu(self, layer: "LinearBase", x: torch.Tensor, residual: torch.Tensor | None, norm: Norm,
                        silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
                        ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """A gate|up projection after the norm: (out, x + residual, whether SiLU-mul was applied to out). A method
        that cannot fold the activation into the projection's output leaves it to the next layer's `silu_forward`."""
        out, residual = self.apply_norm(layer, x, residual, norm)
        return out, residual, False

    def apply_silu(self, layer: "LinearBase", gate_up: torch.Tensor,
                   silu_and_mul: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """layer(silu(gate) * up)."""
        return self.apply(layer, silu_and_mul(gate_up))

    def apply_norm_rope(self, layer: "LinearBase", x: torch.Tensor, residual: torch.Tensor | None, norm: Norm,
                        rope: RopeInputs) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The QKV projection with the attention prologue folded in: (rotated q, x + residual), k and v written to
        the caches; None where no kernel does that here (the caller runs apply_norm and the prologue)."""
        return None


PLAIN = LinearMethod()


class LinearBase(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, tp_dim: int | None,
                 tp_rank: int = 0, tp_size: int = 1, method: LinearMethod = PLAIN) -> None:
        super().__init__()
        self.tp_rank, self.tp_size, self.tp_dim = tp_rank, tp_size, tp_dim
        self.method = method
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

    # Every entry goes through self.method (a TP all-reduce would follow it in RowParallelLinear).
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)

    def norm_forward(self, x: torch.Tensor, residual: torch.Tensor | None, norm: Norm
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.method.apply_norm(self, x, residual, norm)

    def norm_silu_forward(self, x: torch.Tensor, residual: torch.Tensor | None, norm: Norm,
                          silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
                          ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        return self.method.apply_norm_silu(self, x, residual, norm, silu_and_mul)

    def silu_forward(self, gate_up: torch.Tensor, silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
                     ) -> torch.Tensor:
        return self.method.apply_silu(self, gate_up, silu_and_mul)

    def norm_rope_forward(self, x: torch.Tensor, residual: torch.Tensor | None, norm: Norm, rope: RopeInputs
                          ) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self.method.apply_norm_rope(self, x, residual, norm, rope)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp_rank: int = 0,
                 tp_size: int = 1, method: LinearMethod = PLAIN) -> None:
        super().__init__(in_features, out_features // tp_size, bias, 0, tp_rank, tp_size, method)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; the partial sums would be all-reduced (one rank: nothing to do)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp_rank: int = 0,
                 tp_size: int = 1, method: LinearMethod = PLAIN) -> None:
        super().__init__(in_features // tp_size, out_features, bias, 1, tp_rank, tp_size, method)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, name: str = "?") -> None:
        if param.dim() > 1:
            loaded = self._shard(loaded, 1)
        _copy_checked(param, loaded, name)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs stacked in one weight (gate | up)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False, tp_rank: int = 0,
                 tp_size: int = 1, method: LinearMethod = PLAIN) -> None:
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias, tp_rank, tp_size, method)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, name: str = "?",
                      shard_id: int = 0) -> None:
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        _copy_checked(param.data.narrow(0, offset, size), self._shard(loaded, 0), name)


class QKVParallelLinear(ColumnParallelLinear):
    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
                 tp_rank: int = 0, tp_size: int = 1, method: LinearMethod = PLAIN) -> None:
        self.head_dim = head_dim
        self.num_heads = num_heads // tp_size
        self.num_kv_heads = max(1, num_kv_heads // tp_size)
        out = (num_heads + 2 * num_kv_heads) * head_dim
        super().__init__(hidden_size, out, bias, tp_rank, tp_size, method)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, name: str = "?",
                      shard_id: str = "q") -> None:
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[shard_id]
        _copy_checked(param.data.narrow(0, offset, size), self._shard(loaded, 0), name)
