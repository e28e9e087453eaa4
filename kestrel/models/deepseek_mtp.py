"""DeepSeek-V3's multi-token-prediction (MTP) layer as a speculative drafter: vLLM's method `deepseek_mtp`,
SGLang's NEXTN. Loading from the target's checkpoint: models/mtp_loader.py.

The checkpoint carries, past the decoder, num_nextn_predict_layers modules trained beside the model to predict
the token after next (DeepSeek-V3 Technical Report, arXiv:2412.19437, section 2.2 "Multi-Token Prediction",
eqs. 21-23). The module at position i, given the target's representation h_i and the next token t_{i+1}:

    h'_i  = eh_proj([enorm(Emb(t_{i+1})) | hnorm(h_i)])       [T, 2 H] -> [T, H]
    h''_i = block(h'_i)      one decoder layer of the target's kind (latent attention + MoE for DeepSeek-V3),
                             causal over the positions, in its own one-layer cache
    logits of t_{i+2} = OutHead(shared_head.norm(h''_i))      Emb and OutHead: the target's, shared

The report writes the concatenation as [RMSNorm(h); RMSNorm(Emb)]; the released eh_proj reads [embedding |
hidden], which is how vLLM and SGLang load it, so that order is kept. h_i is the target's last hidden state after
its final norm (what its lm_head reads, as both engines hand it over). A further draft step feeds back the
module's own normed output (SGLang's choice; the same kind of state as the target's, the one OutHead reads).

As a drafter it has the interface speculative/eagle3_proposer.py drives (the EAGLE-3 drafter's): the target layer
whose input it reads (config.aux_layer_ids: layer L = num_hidden_layers, the final pre-norm stream, which
from_target puts through the target's final norm), forward, compute_logits, draft_to_target, kv_cache_shape.

Its cache is one layer of the target's kind, in the target's block ids:

    latent attention   [1, num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]   (latent,)
    GQA attention      [2, num_blocks, block_size, num_kv_heads, head_dim]                (k, v)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kestrel.attention.base import AttentionBackend
from kestrel.batch import ForwardBatch
from kestrel.distributed.comm import SINGLE
from kestrel.layers.linear import LinearBase
from kestrel.layers.norm import RMSNorm
from kestrel.layers.ops import TORCH_OPS, LayerOps
from kestrel.models.model_config import ModelConfig


@dataclass(frozen=True, slots=True)
class MTPConfig:
    target: ModelConfig
    layer_index: int   # L = target.num_layers: the checkpoint's model.layers.L.* is the module

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        """The target states the drafter reads: the input of layer L, i.e. the final stream before the norm."""
        return (self.layer_index,)

    @property
    def hidden_size(self) -> int:
        return self.target.hidden_size


class SharedHead(nn.Module):
    """The checkpoint's `shared_head`: its norm is the module's own; its `head` is the target's lm_head (unread)."""

    def __init__(self, hidden_size: int, eps: float, ops: LayerOps) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps, ops.rms_norm)


class MTPDrafter(nn.Module):
    def __init__(self, target: nn.Module, ops: LayerOps = TORCH_OPS, embedding: nn.Module | None = None,
                 head_weight: torch.Tensor | None = None) -> None:
        """target: the loaded target model (its layer builder, rotary table, final norm, embedding and lm_head).
        embedding / head_weight: the whole tables when the target's are split over ranks (gathered on the
        drafting rank); default the target's own."""
        super().__init__()
        cfg: ModelConfig = target.config
        self.config = MTPConfig(cfg, cfg.num_layers)
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.enorm = RMSNorm(h, eps, ops.rms_norm)
        self.hnorm = RMSNorm(h, eps, ops.rms_norm)
        self.eh_proj = LinearBase(2 * h, h, False, tp_dim=None, method=ops.linear_method)   # whole: rank 0 drafts
        # the target's own layer kind at index L (past first_k_dense_replace: a MoE layer), unsplit
        self.block = target.make_layer(cfg.num_layers, cfg, target.rotary, ops, SINGLE)
        self.shared_head = SharedHead(h, eps, ops)
        # the same fragments as the target's (q|k|v, gate|up, the experts): the block's names are a layer's
        self.packed_modules = target.packed_modules
        # In a tuple, not child modules: the target's to load, move and keep.
        self._shared = (embedding if embedding is not None else target.embed_tokens,
                        head_weight if head_weight is not None else target.lm_head.weight, target.norm)

    def from_target(self, aux: torch.Tensor) -> torch.Tensor:
        """The captured input of layer L [T, H] -> h_i, the target's final-normed state [T, H]."""
        return self._shared[2](aux)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self._shared[0](input_ids)

    def forward(self, batch: ForwardBatch, hidden: torch.Tensor, backend: AttentionBackend,
                kv_cache: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, H]: from_target's states or the drafter's previous output. Returns (normed hidden at
        batch.logits_at, all rows for None; the normed output of every row, fed back for the next draft)."""
        embeds = self.embed(batch.input_ids) if batch.input_embeds is None else batch.input_embeds
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        out, residual = self.block(x, None, batch, backend, *kv_cache)
        normed, _ = self.shared_head.norm(out, residual)
        return (normed if batch.logits_at is None else normed[batch.logits_at]), normed

    def compute_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """[N, H] -> [N, vocab] float32, through the target's output head."""
        return F.linear(normed, self._shared[1]).float()

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids   # the target's vocabulary

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        cfg = self.config.target
        if cfg.kv_lora_rank:
            return (1, num_blocks, block_size, 1, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        return (2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
