"""The EAGLE-3 drafter: one Llama decoder layer that reads the target's hidden states (SpecForge / SGLang / vLLM
checkpoint format, `LlamaForCausalLMEagle3`). Loading and validation: models/eagle3_loader.py.

    h0 = fc(aux)  when hidden is the target's three captured layer inputs [T, 3 Ht], else hidden [T, H] as is
         (the drafter's own previous output, fed back for the next draft token)
    x = cat([input_layernorm(embed(tokens)), hidden_norm(h0)])          [T, 2 H]: q/k/v read both halves
    h1 = o_proj(attention(qkv_proj(x))) + h0
    out = mlp(post_attention_layernorm(h1)) + h1                          [T, H]: the recurrent hidden
    logits = lm_head(norm(out))                                           [T, draft_vocab]
    target id = draft id + d2t[draft id]
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kestrel.attention.base import AttentionBackend
from kestrel.batch import ForwardBatch
from kestrel.layers.embedding import LMHead, VocabEmbedding
from kestrel.layers.linear import LinearBase, QKVParallelLinear, RowParallelLinear
from kestrel.layers.norm import RMSNorm
from kestrel.layers.ops import TORCH_OPS, LayerOps
from kestrel.layers.rotary import RotaryEmbedding
from kestrel.models.llama import MLP, LlamaForCausalLM

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"


@dataclass(frozen=True, slots=True)
class Eagle3Config:
    hidden_size: int                 # H, the drafter's width
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    vocab_size: int                  # the target's vocabulary (embedding rows, t2d length)
    draft_vocab_size: int            # lm_head rows; draft id i stands for target id i + d2t[i]
    target_hidden_size: int          # Ht; fc reads the three captured target states, [T, 3 Ht]
    aux_layer_ids: tuple[int, ...]   # target layers whose *input* hidden (hidden + residual) fc reads; L: final
    qkv_bias: bool = False
    fc_bias: bool = False
    has_embedding: bool = False      # its own embed_tokens; otherwise the target's embedding is shared


class Eagle3Attention(nn.Module):
    """Llama attention whose q/k/v read the 2 H concatenation [embedding | hidden] and whose output is H wide."""

    def __init__(self, cfg: Eagle3Config, ops: LayerOps) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        self.qkv_proj = QKVParallelLinear(2 * cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads,
                                          bias=cfg.qkv_bias, method=ops.linear_method)
        self.o_proj = RowParallelLinear(self.q_size, cfg.hidden_size, bias=False, method=ops.linear_method)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling,
                                      ops.apply_rotary)
        # rotary + K/V write in one kernel (layers/ops.py), or None: the backend writes K/V
        self.prologue = ops.attn_prologue

    def forward(self, x: torch.Tensor, batch: ForwardBatch, backend: AttentionBackend, k_cache: torch.Tensor,
                v_cache: torch.Tensor) -> torch.Tensor:
        """x [T, 2 H] -> o_proj(attention) [T, H]; this step's K/V are written to the caches at slot_mapping."""
        qkv = self.qkv_proj(x)
        if self.prologue is not None:
            q = self.prologue(qkv, None, None, 0.0, batch.positions, self.rotary.cos_sin_cache, k_cache, v_cache,
                              batch.slot_mapping, self.num_heads, self.num_kv_heads, self.head_dim)
            out = backend.forward(q, None, None, k_cache, v_cache, batch, self.scale)
        else:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q, k = self.rotary.forward(batch.positions, q.view(-1, self.num_heads, self.head_dim),
                                       k.view(-1, self.num_kv_heads, self.head_dim))
            out = backend.forward(q, k, v.view(-1, self.num_kv_heads, self.head_dim), k_cache, v_cache, batch,
                                  self.scale)
        return self.o_proj(out.reshape(-1, self.q_size))


class Eagle3DecoderLayer(nn.Module):
    """The checkpoint's `midlayer`: a Llama layer with a second input norm (hidden_norm) for the hidden half.

    Not the models' DecoderLayer (models/llama.py): its attention reads two normed inputs concatenated (2 H wide),
    so no norm folds into q/k/v and no residual stream comes in from a layer before; only the MLP half is shared."""

    def __init__(self, cfg: Eagle3Config, ops: LayerOps) -> None:
        super().__init__()
        self.self_attn = Eagle3Attention(cfg, ops)
        self.mlp = MLP(cfg, ops)   # reads hidden_size and intermediate_size only
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops.rms_norm)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops.rms_norm)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops.rms_norm)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch, backend: AttentionBackend,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        attn = self.self_attn(x, batch, backend, k_cache, v_cache)
        mlp_out, residual = self.mlp(attn, hidden, self.post_attention_layernorm)
        return mlp_out + residual


class Eagle3Drafter(nn.Module):
    # Same checkpoint names as the Llama layers: q/k/v and gate/up merged at load.
    packed_modules = LlamaForCausalLM.packed_modules

    def __init__(self, cfg: Eagle3Config, ops: LayerOps = TORCH_OPS,
                 target_embedding: VocabEmbedding | None = None) -> None:
        super().__init__()
        self.config = cfg
        if cfg.has_embedding:
            self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        else:
            assert target_embedding is not None and target_embedding.weight.shape[1] == cfg.hidden_size
        # Kept in a tuple so the target's embedding is not a child module: not ours to load, move or save.
        self._shared_embedding = (target_embedding,)
        self.fc = LinearBase(len(cfg.aux_layer_ids) * cfg.target_hidden_size, cfg.hidden_size, cfg.fc_bias,
                             tp_dim=None, method=ops.linear_method)   # replicated: no TP shard
        self.midlayer = Eagle3DecoderLayer(cfg, ops)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops.rms_norm)
        self.lm_head = LMHead(cfg.draft_vocab_size, cfg.hidden_size)
        # d2t[i]: target id of draft id i, minus i.   t2d[j]: target id j has a draft id.
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))

    def from_target(self, aux: torch.Tensor) -> torch.Tensor:
        """The captured target states [T, 3 Ht] -> the layer's hidden input [T, H] (what forward does with them)."""
        return self.fc(aux)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        embedding = self.embed_tokens if self.config.has_embedding else self._shared_embedding[0]
        return embedding(input_ids)

    def forward(self, batch: ForwardBatch, hidden: torch.Tensor, backend: AttentionBackend,
                kv_cache: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: [T, 3 Ht] target aux states (fc applied) or [T, H] the previous recurrent output. Returns
        (final-normed hidden at batch.logits_at, all rows for None; the recurrent output [T, H] of every row)."""
        embeds = self.embed(batch.input_ids) if batch.input_embeds is None else batch.input_embeds
        if hidden.shape[-1] == self.fc.weight.shape[1]:
            hidden = self.fc(hidden)
        assert hidden.shape[-1] == self.config.hidden_size, hidden.shape
        out = self.midlayer(embeds, hidden, batch, backend, *kv_cache)
        normed = self.norm(out if batch.logits_at is None else out[batch.logits_at])
        return normed, out

    def compute_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """[N, H] -> [N, draft_vocab] float32."""
        return self.lm_head(normed).float()

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        # [2 (k | v), num_blocks, block_size, num_kv_heads, head_dim]: one layer, the target's block ids
        return (2, num_blocks, block_size, self.config.num_kv_heads, self.config.head_dim)
