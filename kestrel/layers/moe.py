"""Mixture-of-experts block: a router picks k experts for each token, each expert's SiLU MLP runs on the tokens
sent to it, and a token's output is the router-weighted sum of its k experts' outputs.

Expert weights are stacked, so one kernel (or one loop) serves every expert and the router's choice is an index:

    w13.weight: [E, 2 I, H]   expert e's rows: gate (I) | up (I)   checkpoint: experts.{e}.gate_proj / up_proj
                                                                   (Mixtral: experts.{e}.w1 / w3)
    w2.weight:  [E, H, I]     expert e's down projection           checkpoint: experts.{e}.down_proj (Mixtral: w2)

Routing is each model's own and runs in float32: the router weight is kept in float32 whatever the model's dtype
(checkpoints store it in bf16 or fp32, both exact in float32) and its logits are computed in float32, as HF's
DeepSeek-V3 / GLM-4-MoE code does (HF's Qwen3-MoE / Mixtral compute them in the model dtype; float32 is the more
precise of the two), so the experts chosen do not flip with the activation dtype:

    softmax_topk          Qwen3-MoE, Mixtral: softmax over all experts, the k largest, optionally renormalised
                          (Mixtral's "top-k, then softmax over those k" is the renormalised form)
    grouped_sigmoid_topk  DeepSeek-V3, GLM-4-MoE: sigmoid scores; the correction bias steers which experts are
                          chosen but never their weights; groups first, then experts inside the chosen groups
                          (`grouped_route` binds the model's settings and reads the router's bias)

The expert computation is a function chosen when the model is built (LayerOps.fused_moe): `fused_experts_torch`
below is the CPU road and the oracle; a fused Triton MoE kernel plugs in there on CUDA with the same arguments.

Tensor parallelism (vLLM's default for MoE): every rank holds every expert, and each expert's intermediate
dimension is split over the ranks, as a dense MLP's is (layers/linear.py). On rank r of N, with I_r = I / N:

    w13.weight: [E, 2 I_r, H]   expert e's rows: gate rows [r I_r, (r+1) I_r) | up rows, the same range
    w2.weight:  [E, H, I_r]     expert e's columns [r I_r, (r+1) I_r)

Gate and up are cut at the same rows, so silu(gate) * up stays elementwise on each rank's slice. The router is
replicated and runs on every rank on the same (all-reduced) hidden states, so every rank picks the same experts
with the same weights; each rank's expert output is a partial sum over its slice of I, and the layer sums them
with one all-reduce (SparseMoE leaves that to its caller, so shared experts join the partial sums first).

Why not split the experts themselves over the ranks (expert parallelism): tokens would have to travel to the
rank that holds their experts and back (two all-to-alls a layer), and a rank's work would follow how many tokens
the router sends to its experts, so the busiest rank sets the pace. Splitting every expert's width keeps every
rank's work equal whatever the routing, needs only the all-reduce a dense MLP has, and runs the same kernels
(torch or Triton) on narrower stacked weights.

FP8 checkpoints (HF block "fp8"): the stacked weights stay FP8 with one scale per 128 x 128 tile beside them
(layers/moe_fp8.py, whose Fp8Experts impl makes them at build and runs them).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kestrel.distributed.comm import SINGLE, TPGroup
from kestrel.kernels.routing import Routing
from kestrel.layers.linear import Placement, _copy_checked, place_slice, silu_and_mul_torch, take_slice

# (x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_ids [T, k], topk_weights [T, k] fp32, silu_and_mul) -> [T, H];
# FP8 experts' impl (layers/moe_fp8.py) also takes w13_scale= / w2_scale= and makes its weights (create_weights)
ExpertsImpl = Callable[..., torch.Tensor]


def softmax_topk(logits: torch.Tensor, k: int, renormalize: bool) -> Routing:
    """Qwen3-MoE / Mixtral: softmax over all experts, keep the k largest (renormalised to sum 1 if asked)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(ids, weights)


def grouped_sigmoid_topk(logits: torch.Tensor, k: int, correction_bias: torch.Tensor, n_group: int,
                         topk_group: int, renormalize: bool, scaling: float) -> Routing:
    """DeepSeek-V3's router. Experts are n_group consecutive groups; a group's score is the sum of its two best
    biased scores; each token keeps its topk_group best groups and picks its k best biased scores among their
    experts. The weights are the chosen experts' *unbiased* sigmoid scores (the bias balances load, it never
    weighs an output), renormalised if asked, times routed_scaling_factor."""
    scores = logits.float().sigmoid()                                   # [T, E]
    biased = scores + correction_bias.float()
    tokens, experts = biased.shape
    grouped = biased.view(tokens, n_group, experts // n_group)
    group_scores = grouped.topk(min(2, experts // n_group), dim=-1).values.sum(dim=-1)   # [T, n_group]
    chosen_groups = group_scores.topk(topk_group, dim=-1, sorted=False).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, chosen_groups, True)
    expert_mask = group_mask[:, :, None].expand_as(grouped).reshape(tokens, experts)
    ids = biased.masked_fill(~expert_mask, float("-inf")).topk(k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return Routing(ids, weights * scaling)


def grouped_route(k: int, n_group: int, topk_group: int, renormalize: bool,
                  scaling: float) -> Callable[[torch.Tensor, Router], Routing]:
    """SparseMoE's `route` for DeepSeek-V3 and GLM-4-MoE: grouped_sigmoid_topk with the model's settings, steered by
    the router's correction bias."""
    def route(logits: torch.Tensor, gate: Router) -> Routing:
        return grouped_sigmoid_topk(logits, k, gate.e_score_correction_bias, n_group, topk_group, renormalize,
                                    scaling)
    return route


def fused_experts_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                        topk_weights: torch.Tensor,
                        silu_and_mul: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul_torch) -> torch.Tensor:
    """The reference expert computation: each expert that received tokens runs once on exactly those tokens.

    The (token, slot) pairs are sorted by expert, so expert e's rows are one contiguous run of `order`:

        topk_ids  [T, k] ──flatten──► [T k] ──argsort──► order: rows of expert 0 | rows of expert 1 | ...
        row r of the flattened ids is token r // k's slot r % k

    Outputs are summed in float32 and in expert order, then cast back. Reads the per-expert counts on the host,
    which a CUDA graph cannot: while one is being captured every expert runs on every token instead (weight 0
    where not chosen), correct and E / k times the work, until the fused kernel takes this op's place on CUDA."""
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        return _experts_dense(x, w13, w2, topk_ids, topk_weights, silu_and_mul)
    num_tokens, k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    flat_weights = topk_weights.reshape(-1).float()
    out = torch.zeros(num_tokens, w2.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = order[start:start + count]
        start += count
        tokens = rows // k
        hidden = silu_and_mul(F.linear(x[tokens], w13[expert]))
        y = F.linear(hidden, w2[expert])
        out.index_add_(0, tokens, y.float() * flat_weights[rows, None])
    return out.to(x.dtype)


def _experts_dense(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                   topk_weights: torch.Tensor, silu_and_mul: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """fused_experts_torch without host reads: each expert on all tokens, weighted by the router (0: not chosen)."""
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    for expert in range(w13.shape[0]):
        weight = (topk_weights.float() * (topk_ids == expert)).sum(dim=-1)     # [T]
        y = F.linear(silu_and_mul(F.linear(x, w13[expert])), w2[expert])
        out += y.float() * weight[:, None]
    return out.to(x.dtype)


def check_moe_tp_shape(moe_intermediate_size: int, tp_size: int) -> str | None:
    """Why a model's experts cannot be split over tp_size ranks (None: they can)."""
    if moe_intermediate_size % tp_size:
        return (f"its expert width (moe_intermediate_size) {moe_intermediate_size} does not divide evenly over "
                f"{tp_size} ranks")
    return None


class StackedWeight(nn.Module):
    """One [E, rows, cols] weight (this rank's slice of every expert) filled one expert, and one part of an
    expert's rows, at a time. A checkpoint tensor [rows / parts, cols] (whole: every rank reads the same file)
    arrives with shard id (expert, part) and lands in rows [part * rows_r / parts, (part + 1) * rows_r / parts)
    of expert `expert`, cut along `tp_dim` as the dense linears cut theirs (layers/linear.py: Placement):

        tp_dim 0 (w13, column-parallel)  this rank's rows of each part: gate and up shards stay aligned
        tp_dim 1 (w2, row-parallel)      this rank's columns
    """

    def __init__(self, num_experts: int, rows: int, cols: int, parts: int, tp_dim: int,
                 tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.parts, self.tp_dim, self.tp_rank, self.tp_size = parts, tp_dim, tp.rank, tp.size
        shape = (rows // tp.size, cols) if tp_dim == 0 else (rows, cols // tp.size)
        self.weight = nn.Parameter(torch.empty(num_experts, *shape), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def placement(self, part: int) -> Placement:
        """Where this rank's slice of part `part` of one expert's checkpoint tensor goes in that expert's rows."""
        rows, cols = self.weight.shape[1:]
        if self.tp_dim == 1:
            return Placement(1, 0, self.tp_rank * cols, cols, cols * self.tp_size)
        size = rows // self.parts
        return Placement(0, part * size, self.tp_rank * size, size, size * self.tp_size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, name: str = "?",
                      shard_id: tuple[int, int] = (0, 0)) -> None:
        expert, part = shard_id
        place = self.placement(part)
        _copy_checked(place_slice(param.data[expert], place), take_slice(loaded, place, name), name)


def expert_weight_names(num_experts: int, gate: str, up: str, down: str) -> dict[str, tuple[str, tuple[int, int]]]:
    """The loader's `packed_modules` entries that put checkpoint experts.{e}.{gate,up,down} into the stacked
    weights (gate -> w13 part 0, up -> w13 part 1, down -> w2)."""
    names: dict[str, tuple[str, tuple[int, int]]] = {}
    for e in range(num_experts):
        names[f"experts.{e}.{gate}"] = ("experts.w13", (e, 0))
        names[f"experts.{e}.{up}"] = ("experts.w13", (e, 1))
        names[f"experts.{e}.{down}"] = ("experts.w2", (e, 0))
    return names


class FusedExperts(nn.Module):
    """The stacked experts, this rank's slice of each expert's width (intermediate_size is the full width); the
    output is this rank's partial sum (all of it with one rank)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, impl: ExpertsImpl,
                 silu_and_mul: Callable[[torch.Tensor], torch.Tensor], tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.num_experts, self.hidden_size, self.intermediate_size, self.tp = (num_experts, hidden_size,
                                                                               intermediate_size, tp)
        self.impl = impl
        self.silu_and_mul = silu_and_mul
        # an impl with its own weight layout (layers/moe_fp8.py: FP8 experts with tile scales) makes them
        create = getattr(impl, "create_weights", None)
        if create is not None:
            create(self)
        else:
            self.make_float_weights()

    def make_float_weights(self) -> None:
        e, h, i, tp = self.num_experts, self.hidden_size, self.intermediate_size, self.tp
        self.w13 = StackedWeight(e, 2 * i, h, parts=2, tp_dim=0, tp=tp)
        self.w2 = StackedWeight(e, h, i, parts=1, tp_dim=1, tp=tp)

    def forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        scale13 = getattr(self.w13, "scale", None)   # FP8 experts: their tile scales go with them
        if scale13 is not None:
            return self.impl(x, self.w13.weight, self.w2.weight, routing.topk_ids, routing.topk_weights,
                             self.silu_and_mul, w13_scale=scale13, w2_scale=self.w2.scale)
        return self.impl(x, self.w13.weight, self.w2.weight, routing.topk_ids, routing.topk_weights,
                         self.silu_and_mul)


class Router(nn.Module):
    """The gate: logits = x @ weight.T in float32. With a correction bias (DeepSeek-V3) it is loaded too."""

    def __init__(self, num_experts: int, hidden_size: int, correction_bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32), requires_grad=False)
        self.weight.weight_loader = lambda p, t, name="?": _copy_checked(p, t, name)
        if correction_bias:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32),
                                                        requires_grad=False)
            self.e_score_correction_bias.weight_loader = lambda p, t, name="?": _copy_checked(p, t, name)
        else:
            self.e_score_correction_bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight)


class SparseMoE(nn.Module):
    """Router + stacked experts on already-normalised hidden states [T, H] -> [T, H]. `route` turns the router's
    float32 logits into a Routing (softmax_topk or grouped_sigmoid_topk with the model's settings bound).

    Under tensor parallelism the router is whole on every rank (same input, same experts chosen everywhere) and
    forward returns this rank's partial sum, unreduced: the caller all-reduces once per layer, after adding any
    shared experts' partial sums (models/llama_moe.py: MoEMLP)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 route: Callable[[torch.Tensor, Router], Routing], impl: ExpertsImpl,
                 silu_and_mul: Callable[[torch.Tensor], torch.Tensor], correction_bias: bool = False,
                 tp: TPGroup = SINGLE, route_hidden: Callable[[torch.Tensor, Router], Routing] | None = None
                 ) -> None:
        super().__init__()
        self.gate = Router(num_experts, hidden_size, correction_bias)
        self.experts = FusedExperts(num_experts, hidden_size, intermediate_size, impl, silu_and_mul, tp)
        self.route = route
        # route(gate(x)) in one call from x itself, where the routing's kernels fold the router GEMV in
        # (kernels/triton/moe_routing.py: router_softmax_topk_triton); it must equal route(gate(x), gate)
        self.route_hidden = route_hidden

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.route_hidden is not None:
            return self.experts(x, self.route_hidden(x, self.gate))
        return self.experts(x, self.route(self.gate(x), self.gate))
