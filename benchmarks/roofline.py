"""The bs1 decode roofline: weight bytes one decode step reads, over the measured copy bandwidth.

A decode step reads every weight once except the input embedding table, of which it reads one row per token. When
the embedding is tied to the LM head the head reads the whole table anyway, so it counts once; when it is not
(Llama-3.1-8B: 1.05 GB of 16.06 GB) the table is not part of the step's bytes. Counting it anyway, as sessions 1-8
did, put the 8B roofline at 266 tok/s instead of ~285 (BENCHMARKS.md, session 9).
"""
from __future__ import annotations

from torch import nn


def weight_bytes(model: nn.Module) -> int:
    """Bytes of all the model's parameters, shared ones once."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def decode_weight_bytes(model: nn.Module) -> int:
    """Bytes of weights one single-token decode step reads: all parameters (shared ones once), less the input
    embedding table when no other module reads it, plus the one row of it the token looks up."""
    total = weight_bytes(model)
    embed = model.embed_tokens.weight
    lm_head = getattr(model, "lm_head", None)
    if lm_head is None or lm_head.weight is not embed:
        total -= embed.numel() * embed.element_size() - embed.shape[1] * embed.element_size()
    return total
