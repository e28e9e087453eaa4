"""The Llama family (Llama, Llama-3, Mistral, Qwen2, Qwen3): one model, differences are config flags.

    Qwen2: bias on q/k/v.   Qwen3: RMSNorm on each head of q and k before rotary.   Llama-3: scaled rotary.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kestrel.attention.base import AttentionBackend
from kestrel.engine.batch import ForwardBatch
from kestrel.layers.embedding import LMHead, VocabEmbedding
from kestrel.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from kestrel.layers.norm import RMSNorm
from kestrel.layers.rotary import RotaryEmbedding
from kestrel.layers.skinny import SkinnyMatmuls
from kestrel.models.model_config import ModelConfig


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads,
                                          bias=cfg.qkv_bias)
        self.o_proj = RowParallelLinear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rotary = rotary   # shared by all layers, not a child module (one cos/sin cache)
        # set by fast_path (opt-in): qk_norm_rope_store, q/k norm + rotary + K/V write in one kernel
        self.prologue = None

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch, backend: AttentionBackend,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        return self.o_proj(self.attend(self.qkv_proj(hidden), batch, backend, k_cache, v_cache))

    def prologue_folds_into_qkv(self, batch: ForwardBatch, backend: AttentionBackend) -> bool:
        """Whether a skinny QKV kernel may run this step's attention prologue (rotary, K/V write): a decode
        step on the fused-prologue path of a model without q/k norm."""
        return (batch.is_decode and self.prologue is not None and self.q_norm is None
                and backend.supports_prewritten_kv() and not backend.decodes_from_qkv())

    def attend_prewritten(self, q: torch.Tensor, batch: ForwardBatch, backend: AttentionBackend,
                          k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """Rotated q [T, num_heads, head_dim], this step's K/V already in the cache -> attention output."""
        return backend.forward(q, None, None, k_cache, v_cache, batch, self.scale).reshape(-1, self.q_size)

    def attend(self, qkv: torch.Tensor, batch: ForwardBatch, backend: AttentionBackend,
               k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """Projected q|k|v [T, q + 2 kv] -> attention output [T, num_heads * head_dim], before o_proj."""
        if self.prologue is not None:
            q_norm_w = self.q_norm.weight if self.q_norm is not None else None
            k_norm_w = self.k_norm.weight if self.k_norm is not None else None
            eps = self.q_norm.eps if self.q_norm is not None else 0.0
            if batch.is_decode and backend.decodes_from_qkv():   # prologue + decode in one launch (experiment)
                out = backend.decode_from_qkv(qkv, q_norm_w, k_norm_w, eps, batch.positions,
                                              self.rotary.cos_sin_cache, k_cache, v_cache, batch, self.num_heads,
                                              self.num_kv_heads, self.head_dim, self.scale)
                return out.reshape(-1, self.q_size)
            q = self.prologue(qkv, q_norm_w, k_norm_w, eps, batch.positions, self.rotary.cos_sin_cache,
                              k_cache, v_cache, batch.slot_mapping, self.num_heads, self.num_kv_heads,
                              self.head_dim)
            return self.attend_prewritten(q, batch, backend, k_cache, v_cache)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary.forward(batch.positions, q, k)
        out = backend.forward(q, k, v, k_cache, v_cache, batch, self.scale)
        return out.reshape(-1, self.q_size)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size)
        self.silu_and_mul = None   # set by the runner on CUDA: fused Triton kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.silu_and_mul is not None:
            return self.down_proj(self.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, rotary)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.skinny: SkinnyMatmuls | None = None   # set by fast_path on CUDA: small-batch fused matmuls

    def forward(self, hidden, residual, batch, backend, k_cache, v_cache):
        skinny = self.skinny
        if skinny is not None and hidden.shape[0] <= skinny.max_rows:
            return self._forward_skinny(skinny, hidden, residual, batch, backend, k_cache, v_cache)
        # The residual stream is carried separately so the add can fuse into the next norm.
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, batch, backend, k_cache, v_cache)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual

    def _forward_skinny(self, sk: SkinnyMatmuls, hidden, residual, batch, backend, k_cache, v_cache):
        """Decode-sized batches: each norm rides in the matmul after it, SiLU-mul in the down projection."""
        attn, mlp = self.self_attn, self.mlp
        folded = attn.prologue_folds_into_qkv(batch, backend) and sk.norm_linear_rope(
            hidden, residual, self.input_layernorm, attn.qkv_proj, positions=batch.positions,
            cos_sin_cache=attn.rotary.cos_sin_cache, k_cache=k_cache, v_cache=v_cache,
            slot_mapping=batch.slot_mapping, num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads,
            head_dim=attn.head_dim)
        if folded:
            q, residual = folded
            hidden = sk.linear(attn.attend_prewritten(q, batch, backend, k_cache, v_cache), attn.o_proj)
        else:
            qkv, residual = sk.norm_linear(hidden, residual, self.input_layernorm, attn.qkv_proj)
            hidden = sk.linear(attn.attend(qkv, batch, backend, k_cache, v_cache), attn.o_proj)
        return sk.mlp(hidden, residual, self.post_attention_layernorm, mlp.gate_up_proj, mlp.down_proj,
                      mlp.silu_and_mul)


class LlamaForCausalLM(nn.Module):
    # checkpoint name fragment -> (our parameter fragment, shard id) for merged weights
    packed_modules = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.rotary = rotary
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, rotary) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, batch: ForwardBatch, backend: AttentionBackend,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Returns the final-norm hidden states at batch.logits_at (all of them for None) and the requested layer
        inputs."""
        hidden = self.embed_tokens(batch.input_ids) if batch.input_embeds is None else batch.input_embeds
        residual = None
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            if i in batch.capture_hidden_layers:
                captured[i] = hidden if residual is None else hidden + residual
            hidden, residual = layer(hidden, residual, batch, backend, *kv_caches[i])
        hidden, _ = self.norm(hidden, residual)
        return (hidden if batch.logits_at is None else hidden[batch.logits_at]), captured

    def compute_logits(self, hidden: torch.Tensor, to_float: bool = True) -> torch.Tensor:
        logits = self.lm_head(hidden)
        return logits.float() if to_float else logits
