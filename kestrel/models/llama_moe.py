"""Llama-family models whose MLPs are mixtures of experts: Qwen3-MoE and Mixtral.

Attention is the Llama family's (models/llama.py: Qwen3-MoE has Qwen3's q/k norm, Mixtral is Mistral's); the MLP
slot of a layer holds a SparseMoE (layers/moe.py) with the model's routing:

    Qwen3-MoE  softmax top-k, renormalised if norm_topk_prob; layers in mlp_only_layers, or off the
               decoder_sparse_step grid, keep a dense MLP (ModelConfig.dense_layers)
    Mixtral    top-2 of the logits, softmax over those two (= softmax top-2, renormalised); every layer sparse

Checkpoint names: Qwen3-MoE mlp.gate.weight, mlp.experts.{e}.{gate,up,down}_proj.weight; Mixtral
block_sparse_moe.gate.weight, block_sparse_moe.experts.{e}.{w1,w3,w2}.weight (gate, up, down); the experts go
into the stacked weights through `packed_modules` (layers/moe.py draws them).

Tensor parallelism: attention as the Llama family's (heads split, one all-reduce after o_proj); the MoE block
with every expert on every rank and each expert's width split (layers/moe.py says why not expert parallelism),
the router replicated, shared experts split the same way, and ONE all-reduce of the block's output a layer.
GLM-4-MoE and DeepSeek-V3 (whose latent attention splits its heads: deepseek_v3.py) use the same MoEMLP.
"""
from __future__ import annotations

import re
from functools import partial
from typing import Callable

import torch
from torch import nn

from kestrel.distributed.comm import SINGLE, TPGroup
from kestrel.errors import ModelLoadError
from kestrel.layers.moe import Router, Routing, SparseMoE, check_moe_tp_shape, expert_weight_names
from kestrel.layers.norm import RMSNorm
from kestrel.layers.ops import TORCH_OPS, LayerOps
from kestrel.models.llama import MLP, LlamaForCausalLM
from kestrel.models.model_config import ModelConfig


def check_experts_split(cfg: ModelConfig, tp: TPGroup) -> None:
    """Refuse a TP size that does not divide the experts' width (each rank holds an equal slice of it)."""
    why = check_moe_tp_shape(cfg.moe_intermediate_size, tp.size)
    if why is not None:
        raise ModelLoadError(f"--tensor-parallel-size {tp.size}: {cfg.architecture} cannot be split, {why}")


def is_past_last_layer(name: str, num_layers: int) -> bool:
    """model.layers.{i}.* with i >= num_layers: the multi-token-prediction layer(s) DeepSeek-V3 and GLM-4.5
    checkpoints carry after the decoder (num_nextn_predict_layers): not the target's to load (speculative method
    deepseek_mtp loads it as a drafter: models/mtp_loader.py)."""
    match = re.match(r"(?:model\.)?layers\.(\d+)\.", name)
    return match is not None and int(match.group(1)) >= num_layers


class MoEMLP(SparseMoE):
    """The MLP slot of a sparse layer: (moe(norm(hidden + residual)) [+ shared experts], hidden + residual).

    Under tensor parallelism the routed experts and the shared experts each give this rank's partial sum (both
    split along their width); they are added first and all-reduced once, so a layer costs one all-reduce here
    as a dense MLP does."""

    def __init__(self, cfg: ModelConfig, ops: LayerOps, route: Callable[[torch.Tensor, Router], Routing],
                 correction_bias: bool = False, tp: TPGroup = SINGLE,
                 route_hidden: Callable[[torch.Tensor, Router], Routing] | None = None) -> None:
        check_experts_split(cfg, tp)
        super().__init__(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, route, ops.fused_moe,
                         ops.silu_and_mul, correction_bias, tp, route_hidden)
        self.tp = tp
        # DeepSeek: an always-on MLP beside the routed experts, as wide as n_shared experts together; its
        # down_proj leaves its partial sums unreduced, for the one all-reduce below
        self.shared_experts = MLP(cfg, ops, tp, intermediate_size=cfg.moe_intermediate_size * cfg.n_shared_experts,
                                  reduce_results=False) if cfg.n_shared_experts else None

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor, norm: RMSNorm
                ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = norm(hidden, residual)
        out = super().forward(x)
        if self.shared_experts is not None:
            shared = self.shared_experts
            out = out + shared.down_proj(shared.silu_and_mul(shared.gate_up_proj(x)))
        return self.tp.all_reduce(out), residual


def _softmax_route(cfg: ModelConfig, route: Callable[[torch.Tensor, int, bool], Routing], logits: torch.Tensor,
                   gate: Router) -> Routing:
    return route(logits, cfg.num_experts_per_tok, cfg.norm_topk_prob)   # LayerOps.softmax_topk


def _softmax_route_hidden(cfg: ModelConfig, ops: LayerOps) -> Callable[[torch.Tensor, Router], Routing] | None:
    """_softmax_route(gate(x)) from x in one call, where LayerOps.softmax_topk offers it (`from_hidden`: the Triton
    routing, which folds the float32 router GEMV into its launches at decode); None: the router, then routing."""
    from_hidden = getattr(ops.softmax_topk, "from_hidden", None)
    if from_hidden is None:
        return None
    return lambda x, gate: from_hidden(x, gate.weight, cfg.num_experts_per_tok, cfg.norm_topk_prob)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    expert_names = ("gate_proj", "up_proj", "down_proj")   # an expert's gate, up and down in the checkpoint

    def __init__(self, cfg: ModelConfig, ops: LayerOps = TORCH_OPS, tp: TPGroup = SINGLE) -> None:
        super().__init__(cfg, ops, tp)
        # experts first: the loader takes the first fragment a name contains, and "gate_proj" is in both
        self.packed_modules = {**expert_weight_names(cfg.num_experts, *self.expert_names),
                               **LlamaForCausalLM.packed_modules}

    def make_moe(self, cfg: ModelConfig, ops: LayerOps, tp: TPGroup) -> nn.Module:
        return MoEMLP(cfg, ops, partial(_softmax_route, cfg, ops.softmax_topk), tp=tp,
                      route_hidden=_softmax_route_hidden(cfg, ops))


class MixtralForCausalLM(Qwen3MoeForCausalLM):
    """Qwen3-MoE's layers and routing (every layer sparse: Mixtral's config has no dense layers) under Mixtral's
    checkpoint names."""
    mlp_name = "block_sparse_moe"
    expert_names = ("w1", "w3", "w2")
