"""GLM-4-MoE (GLM-4.5): the Llama family's attention with q/k/v bias, optional q/k norm and rotary on part of each
head (partial_rotary_factor), and DeepSeek-V3's MoE (grouped sigmoid routing, correction bias, shared experts,
the first first_k_dense_replace layers dense).

    attention head: [ rotated (rotary_dim) | unrotated ]      layers/rotary.py: PartialRotaryEmbedding

The fused attention prologue (CUDA) assumes a rotary table as wide as the head, so this model's attention is
built without it; rotary runs through the table's own op on the rotated slice.
The multi-token-prediction layer (num_nextn_predict_layers) is skipped at load (speculative method deepseek_mtp
drafts with it: models/deepseek_mtp.py). Tensor parallelism as Qwen3-MoE's
(models/llama_moe.py): attention heads split, experts and shared experts split along their width, one
all-reduce of the MoE block's output a layer.
"""
from __future__ import annotations

from dataclasses import replace

from torch import nn

from kestrel.distributed.comm import SINGLE, TPGroup
from kestrel.layers.moe import expert_weight_names, grouped_route
from kestrel.layers.ops import TORCH_OPS, LayerOps
from kestrel.layers.rotary import PartialRotaryEmbedding, RotaryEmbedding
from kestrel.models.llama import LlamaForCausalLM
from kestrel.models.llama_moe import MoEMLP, is_past_last_layer
from kestrel.models.model_config import ModelConfig


class Glm4MoeForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig, ops: LayerOps = TORCH_OPS, tp: TPGroup = SINGLE) -> None:
        super().__init__(cfg, ops, tp)
        # experts first: the loader takes the first fragment a name contains, and "gate_proj" is in both
        self.packed_modules = {**expert_weight_names(cfg.num_experts, "gate_proj", "up_proj", "down_proj"),
                               **LlamaForCausalLM.packed_modules}

    def make_rotary(self, cfg: ModelConfig, ops: LayerOps) -> RotaryEmbedding:
        if not cfg.rotary_dim:
            return super().make_rotary(cfg, ops)
        return PartialRotaryEmbedding(cfg.rotary_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling,
                                      ops.apply_rotary)

    def skips_weight(self, name: str) -> bool:
        return is_past_last_layer(name, self.config.num_layers)

    def make_attention(self, cfg: ModelConfig, rotary: RotaryEmbedding, ops: LayerOps, tp: TPGroup) -> nn.Module:
        if cfg.rotary_dim:
            ops = replace(ops, attn_prologue=None)   # the prologue's rotary is full-width
        return super().make_attention(cfg, rotary, ops, tp)

    def make_moe(self, cfg: ModelConfig, ops: LayerOps, tp: TPGroup) -> nn.Module:
        route = grouped_route(cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group, cfg.norm_topk_prob,
                              cfg.routed_scaling_factor)
        return MoEMLP(cfg, ops, route, correction_bias=True, tp=tp)
