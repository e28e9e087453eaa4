"""The Llama family (Llama, Llama-3, Mistral, Qwen2, Qwen3): one model, differences are config flags.

The file is the math and the weight names; which kernels run is the LayerOps the model is built with
(layers/ops.py), handed to every block, and which shard of each weight this process holds is its TPGroup
(distributed/comm.py): attention heads and MLP width split over the ranks, one all-reduce after o_proj and one
after down_proj, the vocabulary split in the embedding and lm_head (layers/linear.py, layers/embedding.py).

    Qwen2: bias on q/k/v.   Qwen3: RMSNorm on each head of q and k before rotary.   Llama-3: scaled rotary.
"""
from __future__ import annotations

import torch
from torch import nn

from kestrel.attention.base import AttentionBackend
from kestrel.distributed.comm import SINGLE, TPGroup
from kestrel.batch import ForwardBatch
from kestrel.layers.embedding import LMHead, VocabEmbedding
from kestrel.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RopeInputs, RowParallelLinear
from kestrel.layers.norm import RMSNorm
from kestrel.layers.ops import TORCH_OPS, LayerOps
from kestrel.layers.rotary import RotaryEmbedding
from kestrel.models.model_config import ModelConfig


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, ops: LayerOps, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads,
                                          bias=cfg.qkv_bias, tp=tp, method=ops.linear_method)
        # this rank's heads (all of them with one rank)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False, tp=tp,
                                        method=ops.linear_method)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, ops.rms_norm) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, ops.rms_norm) if cfg.qk_norm else None
        self.rotary = rotary   # shared by all layers, not a child module (one cos/sin cache)
        # q/k norm + rotary + K/V write in one kernel (layers/ops.py), or None: the backend writes K/V
        self.prologue = ops.attn_prologue
        # an FP8 KV cache's per-tensor scales (cache = x / scale): the checkpoint's (models/kv_scales.py), else
        # 1.0; plain floats, so CUDA graphs capture them as constants. A cache of the model dtype ignores them.
        self.k_scale = self.v_scale = 1.0

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm, batch: ForwardBatch,
                backend: AttentionBackend, k_cache: torch.Tensor, v_cache: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(o_proj(attention(qkv_proj(norm(hidden + residual)))), hidden + residual)."""
        if batch.is_decode and self.prologue is not None and self.q_norm is None:
            # A decode step may run the prologue inside the QKV matmul (where its method has such a kernel).
            folded = self.qkv_proj.norm_rope_forward(hidden, residual, norm, RopeInputs(
                batch.positions, self.rotary.cos_sin_cache, k_cache, v_cache, batch.slot_mapping, self.num_heads,
                self.num_kv_heads, self.head_dim))
            if folded is not None:
                q, residual = folded
                return self.o_proj(self.attend_prewritten(q, batch, backend, k_cache, v_cache)), residual
        qkv, residual = self.qkv_proj.norm_forward(hidden, residual, norm)
        return self.o_proj(self.attend(qkv, batch, backend, k_cache, v_cache)), residual

    def attend_prewritten(self, q: torch.Tensor, batch: ForwardBatch, backend: AttentionBackend,
                          k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """Rotated q [T, num_heads, head_dim], this step's K/V already in the cache -> attention output."""
        return backend.forward(q, None, None, k_cache, v_cache, batch, self.scale, self.k_scale,
                               self.v_scale).reshape(-1, self.q_size)

    def attend(self, qkv: torch.Tensor, batch: ForwardBatch, backend: AttentionBackend,
               k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """Projected q|k|v [T, q + 2 kv] -> attention output [T, num_heads * head_dim], before o_proj."""
        if self.prologue is not None:
            q_norm_w = self.q_norm.weight if self.q_norm is not None else None
            k_norm_w = self.k_norm.weight if self.k_norm is not None else None
            eps = self.q_norm.eps if self.q_norm is not None else 0.0
            q = self.prologue(qkv, q_norm_w, k_norm_w, eps, batch.positions, self.rotary.cos_sin_cache,
                              k_cache, v_cache, batch.slot_mapping, self.num_heads, self.num_kv_heads,
                              self.head_dim, k_scale=self.k_scale, v_scale=self.v_scale)
            return self.attend_prewritten(q, batch, backend, k_cache, v_cache)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary.forward(batch.positions, q, k)
        out = backend.forward(q, k, v, k_cache, v_cache, batch, self.scale, self.k_scale, self.v_scale)
        return out.reshape(-1, self.q_size)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: LayerOps, tp: TPGroup = SINGLE,
                 intermediate_size: int | None = None, reduce_results: bool = True) -> None:
        super().__init__()
        width = intermediate_size or cfg.intermediate_size   # DeepSeek's shared experts are narrower
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [width] * 2, tp=tp,
                                                       method=ops.linear_method)
        # reduce_results=False: partial sums, for a MoE layer's shared experts (reduced with the routed ones)
        self.down_proj = RowParallelLinear(width, cfg.hidden_size, tp=tp, method=ops.linear_method,
                                           reduce_results=reduce_results)
        self.silu_and_mul = ops.silu_and_mul

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor, norm: RMSNorm
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(down(silu(gate) * up) of norm(hidden + residual), hidden + residual); a method may fold the SiLU-mul
        into gate_up's output or into down's input."""
        gate_up, residual, activated = self.gate_up_proj.norm_silu_forward(hidden, residual, norm,
                                                                           self.silu_and_mul)
        if activated:
            return self.down_proj(gate_up), residual
        return self.down_proj.silu_forward(gate_up, self.silu_and_mul), residual


class DecoderLayer(nn.Module):
    """One decoder layer of every model here, dense or MoE: pre-norm attention, then a pre-norm MLP block, on one
    residual stream. The two blocks are parts the model builds (LlamaForCausalLM.make_attention / make_mlp):

        self_attn   Attention (the Llama family, GLM-4-MoE) or MLAttention (DeepSeek-V3: deepseek_v3.py)
        mlp slot    MLP (dense) or MoEMLP (llama_moe.py: routed experts + shared ones), under the checkpoint's
                    name for it (`mlp`; Mixtral: `block_sparse_moe`)

    Each block takes (hidden, residual, its norm) and returns (its output, hidden + residual): the add is fused
    into the norm, and the norm into the block's first matmul where the linear method folds it in. `caches` are
    the layer's cache planes, handed to the attention as they are: (k, v), or MLA's (latent,)."""

    def __init__(self, cfg: ModelConfig, ops: LayerOps, self_attn: nn.Module, mlp: nn.Module,
                 mlp_name: str = "mlp") -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp_name = mlp_name
        self.add_module(mlp_name, mlp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops.rms_norm)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops.rms_norm)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch,
                backend: AttentionBackend, *caches: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual stream is carried separately so the add fuses into the next norm (and the norm into the
        # next matmul, where the linear method folds it in); residual None: hidden is the stream (layer 0).
        hidden, residual = self.self_attn(hidden, residual, self.input_layernorm, batch, backend, *caches)
        return getattr(self, self.mlp_name)(hidden, residual, self.post_attention_layernorm)


class LlamaForCausalLM(nn.Module):
    # checkpoint name fragment -> (our parameter fragment, shard id) for merged weights
    packed_modules = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }
    mlp_name = "mlp"   # the checkpoint's name for a layer's MLP slot (Mixtral: block_sparse_moe)

    def __init__(self, cfg: ModelConfig, ops: LayerOps = TORCH_OPS, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.rotary = rotary = self.make_rotary(cfg, ops)
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(self.make_layer(i, cfg, rotary, ops, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops.rms_norm)
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, tp)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def make_rotary(self, cfg: ModelConfig, ops: LayerOps) -> RotaryEmbedding:
        """The rotary table every layer shares (GLM-4-MoE rotates part of each head: glm4_moe.py)."""
        return RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling,
                               ops.apply_rotary)

    def make_layer(self, index: int, cfg: ModelConfig, rotary: RotaryEmbedding, ops: LayerOps,
                   tp: TPGroup) -> nn.Module:
        """Layer `index`: the model's attention and MLP blocks in the one DecoderLayer."""
        return DecoderLayer(cfg, ops, self.make_attention(cfg, rotary, ops, tp), self.make_mlp(index, cfg, ops, tp),
                            self.mlp_name)

    def make_attention(self, cfg: ModelConfig, rotary: RotaryEmbedding, ops: LayerOps, tp: TPGroup) -> nn.Module:
        """A layer's attention block; DeepSeek-V3 builds its latent attention here, GLM-4-MoE drops the prologue."""
        return Attention(cfg, rotary, ops, tp)

    def make_mlp(self, index: int, cfg: ModelConfig, ops: LayerOps, tp: TPGroup) -> nn.Module:
        """Layer `index`'s MLP block: the dense MLP, or in a MoE model (cfg.num_experts) outside cfg.dense_layers
        the model's sparse block (`make_moe`: llama_moe.py, deepseek_v3.py, glm4_moe.py)."""
        if cfg.num_experts and index not in cfg.dense_layers:
            return self.make_moe(cfg, ops, tp)
        return MLP(cfg, ops, tp)

    def make_moe(self, cfg: ModelConfig, ops: LayerOps, tp: TPGroup) -> nn.Module:
        raise NotImplementedError(f"{cfg.architecture}: no mixture-of-experts block")

    def forward(self, batch: ForwardBatch, backend: AttentionBackend,
                kv_caches: list[tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Returns the final-norm hidden states at batch.logits_at (all of them for None) and the requested layer
        inputs."""
        hidden = self.embed_tokens(batch.input_ids) if batch.input_embeds is None else batch.input_embeds
        residual = None
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            if i in batch.capture_hidden_layers:
                captured[i] = hidden if residual is None else hidden + residual
            hidden, residual = layer(hidden, residual, batch, backend, *kv_caches[i])
        if len(self.layers) in batch.capture_hidden_layers:   # "the input of layer L": the stream before the norm
            captured[len(self.layers)] = hidden + residual
        hidden, _ = self.norm(hidden, residual)
        return (hidden if batch.logits_at is None else hidden[batch.logits_at]), captured

    def compute_logits(self, hidden: torch.Tensor, to_float: bool = True) -> torch.Tensor:
        logits = self.lm_head(hidden)
        return logits.float() if to_float else logits
