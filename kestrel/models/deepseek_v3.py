"""DeepSeek-V3: multi-head latent attention (attention/mla.py) and a sigmoid-routed mixture of experts with a
shared expert (layers/moe.py), in a Llama-shaped decoder (models/llama.py: embedding, residual stream, final norm,
lm_head).

    q:   q_lora_rank set: q_b_proj(q_a_layernorm(q_a_proj(x)))   else q_proj(x)     -> [T, H, nope | rope]
    kv:  kv_a_proj_with_mqa(x) -> c_kv (kv_lora_rank) | k_pe (rope, one head); c_kv = kv_a_layernorm(c_kv)
         the latent cache keeps c_kv | rotated k_pe a token; kv_b_proj's rows are per head [W_UK | W_UV]
    rotary on the rope dims only, interleaved pairs (rope_interleave, the default) or halves
    MLP: layers below first_k_dense_replace dense; the rest grouped sigmoid top-k (e_score_correction_bias
         chooses, never weighs), weights renormalised if norm_topk_prob, times routed_scaling_factor, plus the
         shared experts' MLP on every token

YaRN rope scaling (DeepSeek-V3's released config) scales the rotary table (layers/rotary.py) and the softmax
(`softmax_scale`). Not yet: the multi-token-prediction layer (num_nextn_predict_layers: its weights sit past
num_hidden_layers and are skipped at load; a drafter for speculative decoding later), FP8 block-quantized
checkpoints (the released weights; the FP8 work's linear methods).

Tensor parallelism splits the attention heads, as vLLM does for MLA. On rank r of N (H heads, H_r = H / N):

    q_a_proj, kv_a_proj_with_mqa   replicated: the latents are shared by every head, so every rank computes them
    q_b_proj (q_proj), kv_b_proj   column-parallel: rows are per head, rank r keeps heads [r H_r, (r+1) H_r)
    o_proj                         row-parallel: its columns are per head; one all-reduce
    latent cache                   replicated: every rank writes the same c_kv | k_pe (one shared head, nothing
                                   per head to split) and reads it with its own heads' W_UK / W_UV

The MoE block splits as Qwen3-MoE's (models/llama_moe.py: every expert's width and the shared experts', one
all-reduce), the dense layers as the Llama family's MLP.
"""
from __future__ import annotations

import torch
from torch import nn

from kestrel.attention.base import AttentionBackend
from kestrel.attention.mla import LatentAttention, rotate_interleaved, write_latent
from kestrel.distributed.comm import SINGLE, TPGroup
from kestrel.batch import ForwardBatch
from kestrel.layers.linear import ColumnParallelLinear, RowParallelLinear
from kestrel.layers.moe import expert_weight_names, grouped_route
from kestrel.layers.norm import RMSNorm
from kestrel.layers.ops import TORCH_OPS, LayerOps
from kestrel.layers.rotary import RotaryEmbedding, yarn_mscale
from kestrel.models.llama import LlamaForCausalLM
from kestrel.models.llama_moe import MoEMLP, is_past_last_layer
from kestrel.models.model_config import ModelConfig

LATENT_NORM_EPS = 1e-6   # q_a_layernorm and kv_a_layernorm use DeepSeek's default eps, not rms_norm_eps


def softmax_scale(qk_dim: int, rope_scaling: dict | None) -> float:
    """1/sqrt(qk_dim), times YaRN's mscale(factor, mscale_all_dim)^2 under YaRN (DeepSeek's long-context fix)."""
    scale = qk_dim ** -0.5
    if rope_scaling is not None and rope_scaling.get("mscale_all_dim"):
        scale *= yarn_mscale(float(rope_scaling["factor"]), float(rope_scaling["mscale_all_dim"])) ** 2
    return scale


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, ops: LayerOps, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads // tp.size   # this rank's heads (the module docstring draws the split)
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        qk_dim = self.nope + self.rope
        method = ops.linear_method
        if cfg.q_lora_rank is not None:
            self.q_a_proj = ColumnParallelLinear(cfg.hidden_size, cfg.q_lora_rank, cfg.qkv_bias, method=method)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS, ops.rms_norm)
            self.q_b_proj = ColumnParallelLinear(cfg.q_lora_rank, cfg.num_heads * qk_dim, tp=tp, method=method)
        else:
            self.q_proj = ColumnParallelLinear(cfg.hidden_size, cfg.num_heads * qk_dim, tp=tp, method=method)
        self.kv_a_proj_with_mqa = ColumnParallelLinear(cfg.hidden_size, self.kv_lora_rank + self.rope,
                                                       cfg.qkv_bias, method=method)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS, ops.rms_norm)
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank, cfg.num_heads * (self.nope + self.v_dim), tp=tp,
                                              method=method)
        self.o_proj = RowParallelLinear(cfg.num_heads * self.v_dim, cfg.hidden_size, cfg.qkv_bias, tp=tp,
                                        method=method)
        self.q_lora = cfg.q_lora_rank is not None
        self.interleaved = cfg.rope_interleave
        self.rotary = rotary   # the model's table, rope dims wide (shared, not a child module)
        self.latent = LatentAttention(self.kv_lora_rank, softmax_scale(qk_dim, cfg.rope_scaling))
        # an FP8 latent cache's scale: the checkpoint's k_scale (models/kv_scales.py), else 1.0; v_scale unused
        self.k_scale = self.v_scale = 1.0

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm, batch: ForwardBatch,
                backend: AttentionBackend | None, latent_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(o_proj(MLA(norm(hidden + residual))), hidden + residual); writes this step's latents. backend: the
        runner's (K/V-shaped) attention; MLA runs its own over the latent cache, through the backend's
        latent-decode kernel where it has one."""
        x, residual = (norm(hidden), hidden) if residual is None else norm(hidden, residual)
        tokens = x.shape[0]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        q_nope, q_pe = q.view(tokens, self.num_heads, -1).split([self.nope, self.rope], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)
        k_pe = k_pe.unsqueeze(1)   # [T, 1, rope]: one head shared by all
        if self.interleaved:
            cache = self.rotary.cos_sin_cache
            q_pe = rotate_interleaved(q_pe, batch.positions, cache)
            k_pe = rotate_interleaved(k_pe, batch.positions, cache)
        else:
            q_pe, k_pe = self.rotary.forward(batch.positions, q_pe, k_pe)
        write_latent(torch.cat([c_kv, k_pe.squeeze(1)], dim=-1), latent_cache, batch.slot_mapping, self.k_scale)
        # W_UK and W_UV are kv_b_proj's rows read as per-head matrices, not a call of the layer (a
        # quantized method would hand them over dequantized here).
        w_kv = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.kv_lora_rank)
        out = self.latent.forward(q_nope, q_pe, w_kv[:, :self.nope], w_kv[:, self.nope:], latent_cache, batch,
                                  backend, self.k_scale)
        return self.o_proj(out.reshape(tokens, self.num_heads * self.v_dim)), residual


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig, ops: LayerOps = TORCH_OPS, tp: TPGroup = SINGLE) -> None:
        super().__init__(cfg, ops, tp)
        # experts first (the loader takes the first fragment a name contains); only gate|up are merged: DeepSeek
        # has no q/k/v projections ("q_proj" is its own layer when q_lora_rank is None)
        self.packed_modules = {**expert_weight_names(cfg.num_experts, "gate_proj", "up_proj", "down_proj"),
                               "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def skips_weight(self, name: str) -> bool:
        return is_past_last_layer(name, self.config.num_layers)

    def make_attention(self, cfg: ModelConfig, rotary: RotaryEmbedding, ops: LayerOps, tp: TPGroup) -> nn.Module:
        return MLAttention(cfg, rotary, ops, tp)

    def make_moe(self, cfg: ModelConfig, ops: LayerOps, tp: TPGroup) -> nn.Module:
        route = grouped_route(cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group, cfg.norm_topk_prob,
                              cfg.routed_scaling_factor)
        return MoEMLP(cfg, ops, route, correction_bias=True, tp=tp)
