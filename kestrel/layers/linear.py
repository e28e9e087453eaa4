"""Linear layers that know their tensor-parallel shard, and hold their method.

Every call of a linear layer goes through its `method` (a LinearMethod, chosen when the model is built): the plain
matmul, the decode-sized kernels of layers/skinny.py, later FP8, so no path through the model can skip it. A layer
also offers the folds a decoder composes (the norm before it, SiLU-mul on its input or output, the attention
prologue after it); the method decides per call whether one kernel does the fold or the unfused ops run.

Every parameter carries a `weight_loader(param, loaded[, shard_id])` that copies this rank's slice of a checkpoint
tensor; with one rank the slice is the whole tensor. Where that slice lies is one `Placement` per (layer, shard),
so a quantized method's scales (layers/fp8.py) are cut along the same rows and columns as their weight. QKV and
gate/up are merged at load so one GEMM serves several checkpoint tensors. On rank r of N (heads H, KV heads K):

    qkv_proj.weight: [(H/N + 2 * K_r) * head_dim, hidden]   rows: q heads [r H/N, (r+1) H/N) | k | v
                     K_r = K/N KV heads from r K/N when K >= N; else one, KV head r // (N/K), replicated on N/K ranks
    gate_up_proj.weight: [2 * intermediate/N, hidden]        rows: gate | up, each rank's slice of both
    o_proj, down_proj: [hidden, in/N]                        columns sliced; the partial sums are all-reduced

Column-parallel layers need no communication (each rank keeps its heads / its intermediate slice); a row-parallel
layer ends in one all-reduce, after its method, so every method (plain, skinny, FP8) is reduced the same way.

A method may own the layer's weights (`LinearMethod.create_weights`, called by `LinearBase.set_method` before any
weight is loaded): the FP8 method replaces `weight` by FP8 values and adds their scales.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from kestrel.distributed.comm import SINGLE, TPGroup
from kestrel.errors import ModelLoadError

Norm = Callable[..., Any]   # RMSNorm: norm(x) -> y, norm(x, residual) -> (y, x + residual)


def _copy_checked(param: torch.Tensor, loaded: torch.Tensor, what: str) -> None:
    if param.shape != loaded.shape:
        raise ModelLoadError(f"tensor {what}: checkpoint shape {tuple(loaded.shape)} does not match the "
                             f"expected {tuple(param.shape)}")
    param.data.copy_(loaded)


def take_slice(loaded: torch.Tensor, place: "Placement", name: str) -> torch.Tensor:
    """This rank's part of a checkpoint tensor (the whole tensor with one rank)."""
    if loaded.dim() <= place.dim or loaded.shape[place.dim] != place.full:
        raise ModelLoadError(f"tensor {name}: checkpoint shape {tuple(loaded.shape)} does not match the expected "
                             f"{place.full} along dim {place.dim}")
    return loaded.narrow(place.dim, place.src, place.size)


def place_slice(param: torch.Tensor, place: "Placement") -> torch.Tensor:
    return param.narrow(place.dim, place.dst, place.size)


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


@dataclass(frozen=True, slots=True)
class Placement:
    """Where this rank's part of one checkpoint tensor (or one shard of a merged layer) goes, along `dim`:
    loaded[src : src + size] -> param[dst : dst + size]; the checkpoint tensor is `full` long along `dim`."""
    dim: int
    dst: int
    src: int
    size: int
    full: int


class LinearMethod:
    """The plain method: torch ops. Subclasses replace the calls they can do faster and fall back here."""

    def create_weights(self, layer: "LinearBase") -> None:
        """Give the layer the parameters this method reads (in the model's default dtype and device): the plain
        method reads a float `weight` [out, in]."""
        layer.weight = nn.Parameter(torch.empty(layer.out_features, layer.in_features), requires_grad=False)
        layer.weight.weight_loader = layer.weight_loader

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


def kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """KV heads each rank holds: an even share, or one (replicated) when there are fewer KV heads than ranks."""
    return max(1, num_kv_heads // tp_size)


def check_tp_shape(num_heads: int, num_kv_heads: int, intermediate_size: int, tp_size: int) -> str | None:
    """Why a model cannot be split over tp_size ranks (None: it can)."""
    if num_heads % tp_size:
        return f"its {num_heads} attention heads do not divide evenly over {tp_size} ranks"
    if num_kv_heads >= tp_size and num_kv_heads % tp_size:
        return f"its {num_kv_heads} KV heads do not divide evenly over {tp_size} ranks"
    if num_kv_heads < tp_size and tp_size % num_kv_heads:
        return (f"its {num_kv_heads} KV heads cannot be replicated evenly over {tp_size} ranks (the rank count "
                "must be a multiple of the KV head count)")
    if intermediate_size % tp_size:
        return f"its MLP width {intermediate_size} does not divide evenly over {tp_size} ranks"
    return None


class LinearBase(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, tp_dim: int | None,
                 tp: TPGroup = SINGLE, method: LinearMethod = PLAIN) -> None:
        super().__init__()
        self.tp = tp
        self.tp_rank, self.tp_size, self.tp_dim = tp.rank, tp.size, tp_dim
        self.method = method
        self.in_features, self.out_features = in_features, out_features   # this rank's
        method.create_weights(self)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def set_method(self, method: LinearMethod) -> None:
        """Run through `method` from now on; its weights replace the layer's (before any weight is loaded)."""
        self.method = method
        method.create_weights(self)

    def placement(self, shard_id: object = None) -> Placement:
        """This rank's rows (column-parallel) or columns (row-parallel) of a checkpoint tensor."""
        if self.tp_dim == 1:
            return Placement(1, 0, self.tp_rank * self.in_features, self.in_features, self.in_features * self.tp_size)
        size = self.tp_size if self.tp_dim == 0 else 1
        return Placement(0, 0, self.tp_rank * self.out_features if size > 1 else 0, self.out_features,
                         self.out_features * size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, name: str = "?",
                      shard_id: object = None) -> None:
        place = self.placement() if shard_id is None else self.placement(shard_id)
        if param.dim() == 1 and place.dim == 1:
            # a row-parallel bias is whole on every rank and added once: by rank 0's partial sum
            _copy_checked(param, loaded if self.tp_rank == 0 else torch.zeros_like(loaded), name)
            return
        _copy_checked(place_slice(param.data, place), take_slice(loaded, place, name), name)

    # Every entry goes through self.method (RowParallelLinear all-reduces what it returns).
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

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp: TPGroup = SINGLE,
                 method: LinearMethod = PLAIN) -> None:
        super().__init__(in_features, out_features // tp.size, bias, 0, tp, method)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; each rank's partial sums are all-reduced (one rank: nothing to do).

    reduce_results=False leaves the partial sums to the caller, who adds them to other partial sums first and
    all-reduces once: a MoE layer's shared experts join its routed experts' output before the layer's one
    all-reduce (models/llama_moe.py)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp: TPGroup = SINGLE,
                 method: LinearMethod = PLAIN, reduce_results: bool = True) -> None:
        super().__init__(in_features // tp.size, out_features, bias, 1, tp, method)
        self.reduce_results = reduce_results

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(partial) if self.reduce_results else partial

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(self.method.apply(self, x))

    def silu_forward(self, gate_up: torch.Tensor, silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
                     ) -> torch.Tensor:
        return self.reduce(self.method.apply_silu(self, gate_up, silu_and_mul))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs stacked in one weight (gate | up)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False, tp: TPGroup = SINGLE,
                 method: LinearMethod = PLAIN) -> None:
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias, tp, method)

    def placement(self, shard_id: object = 0) -> Placement:
        shard = int(shard_id)
        size = self.output_sizes[shard] // self.tp_size
        return Placement(0, sum(self.output_sizes[:shard]) // self.tp_size, self.tp_rank * size, size,
                         self.output_sizes[shard])


class QKVParallelLinear(ColumnParallelLinear):
    """q | k | v of this rank's heads in one weight (the module docstring draws the rows)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
                 tp: TPGroup = SINGLE, method: LinearMethod = PLAIN) -> None:
        self.head_dim = head_dim
        self.num_heads = num_heads // tp.size
        self.num_kv_heads = kv_heads_per_rank(num_kv_heads, tp.size)
        # which of the checkpoint's KV-head groups this rank holds (a replicated head is held by N/K ranks)
        self.kv_shard = tp.rank // max(1, tp.size // num_kv_heads)
        self.total_heads, self.total_kv_heads = num_heads, num_kv_heads
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        LinearBase.__init__(self, hidden_size, out, bias, 0, tp, method)

    def placement(self, shard_id: object = "q") -> Placement:
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        if shard_id == "q":
            return Placement(0, 0, self.tp_rank * q_size, q_size, self.total_heads * self.head_dim)
        offset = q_size if shard_id == "k" else q_size + kv_size
        return Placement(0, offset, self.kv_shard * kv_size, kv_size, self.total_kv_heads * self.head_dim)
