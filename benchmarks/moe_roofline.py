"""Memory rooflines of a mixture-of-experts model's decode, and its KV cache bytes per token.

A decode step is bound by the bytes it reads. At batch size 1 that is every weight but the experts, plus the k
experts the token picks in each sparse layer (the "active" bytes), plus the token's KV cache. At batch B the
experts read are those any of the B tokens picks: under routing spread evenly, an expert escapes all B tokens with
probability (1 - k/E)^B, so E (1 - (1 - k/E)^B) are touched per layer (128 tokens, top-8 of 128: 127.97, i.e.
all of them). Roofline tok/s = B / (step bytes / copy bandwidth), the copy bandwidth counted as engine_bench's
(bytes read + bytes written of a device-to-device copy, per second).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from benchmarks.engine_bench import decode_weight_bytes
from kestrel.forward.runner import kv_bytes_per_block
from kestrel.layers.moe import FusedExperts
from kestrel.models.model_config import ModelConfig


@dataclass(frozen=True)
class MoeBytes:
    decode_weight_bytes: int     # every weight a step reads when all experts are read (engine_bench's figure)
    expert_bytes: int            # all routed experts' weights, all layers
    sparse_layers: int           # layers whose MLP is routed experts
    num_experts: int
    top_k: int

    def active_weight_bytes(self) -> int:
        """Weights one token's decode step reads: all but the experts it does not pick."""
        return self.step_weight_bytes(1)

    def step_weight_bytes(self, batch: int) -> int:
        touched = expected_touched_experts(self.num_experts, self.top_k, batch)
        return round(self.decode_weight_bytes - self.expert_bytes * (1 - touched / self.num_experts))


def moe_bytes(model: nn.Module, cfg: ModelConfig) -> MoeBytes:
    experts = [m for m in model.modules() if isinstance(m, FusedExperts)]
    expert_bytes = sum(p.numel() * p.element_size() for m in experts for p in m.parameters())
    return MoeBytes(decode_weight_bytes(model), expert_bytes, len(experts), cfg.num_experts, cfg.num_experts_per_tok)


def expected_touched_experts(num_experts: int, top_k: int, batch: int) -> float:
    """Experts of one layer that at least one of `batch` tokens picks, routing spread evenly (module docstring)."""
    return num_experts * (1 - (1 - top_k / num_experts) ** batch)


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """The runner's cache bytes of one token, all layers (MLA: one latent of kv_lora_rank + rope a layer)."""
    return kv_bytes_per_block(cfg, 1, dtype)


def gqa_kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> dict[str, int]:
    """What a Llama-style attention of the same width (hidden / heads = head_dim, same layers) would cache a token,
    K and V planes: with all heads (MHA), 8 KV heads and 4 KV heads. For an MLA model also its own heads expanded
    (K of nope + rope, V of v_head_dim per head): what the up-projected form would cache without the latent."""
    head_dim = cfg.hidden_size // cfg.num_heads
    per = dtype.itemsize * cfg.num_layers
    out = {f"gqa_{kv}_kv_heads_x{head_dim}": 2 * kv * head_dim * per for kv in (cfg.num_heads, 8, 4)
           if kv <= cfg.num_heads}
    if cfg.kv_lora_rank:
        out["mla_heads_expanded"] = cfg.num_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
                                                     + cfg.v_head_dim) * per
    return out


def rooflines(b: MoeBytes, kv_per_token: int, bandwidth: float, batch: int, mean_context: float) -> dict:
    """Roofline tok/s at batch 1 and `batch`, each step also reading its sequences' KV at `mean_context` tokens."""
    bs1_bytes = b.active_weight_bytes() + kv_per_token * mean_context
    step_bytes = b.step_weight_bytes(batch) + batch * kv_per_token * mean_context
    return {
        "active_weight_bytes_per_token": b.active_weight_bytes(),
        "bs1_step_bytes": round(bs1_bytes),
        "bs1_roofline_tok_s": bandwidth / bs1_bytes,
        f"c{batch}_expected_touched_experts_per_layer": expected_touched_experts(b.num_experts, b.top_k, batch),
        f"c{batch}_step_weight_bytes": b.step_weight_bytes(batch),
        f"c{batch}_step_bytes": round(step_bytes),
        f"c{batch}_roofline_tok_s": batch * bandwidth / step_bytes,
        "mean_context_tokens": mean_context,
    }
