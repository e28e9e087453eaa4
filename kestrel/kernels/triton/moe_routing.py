"""Softmax top-k routing (Qwen3-MoE, Mixtral) in one launch: layers/moe.py's `softmax_topk` is four (softmax, top-k,
sum, divide), and at decode each is a launch of a few microseconds on a few hundred numbers, 48 layers a step.

One program a token: its E float32 logits in registers, softmax, then k rounds of "take the largest, mask it"
(the first index on ties), the k weights renormalised if asked. Same contract and the same order as the reference
(k largest, descending); exp is Triton's, so weights agree to float32 rounding and a choice between two experts
whose probabilities tie to the last bit may differ, as between any two softmax implementations.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.layers.moe import Routing


@triton.jit
def _softmax_topk_kernel(logits_ptr, ids_ptr, weights_ptr, stride_l, E: tl.constexpr, K: tl.constexpr,
                         BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, RENORM: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    ok = offs < E
    logits = tl.load(logits_ptr + token * stride_l + offs, mask=ok, other=-float("inf")).to(tl.float32)
    p = tl.exp(logits - tl.max(logits, axis=0))
    p = tl.where(ok, p, 0.0)
    p = p / tl.sum(p, axis=0)
    slots = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_K], dtype=tl.int64)
    weights = tl.zeros([BLOCK_K], dtype=tl.float32)
    for j in tl.static_range(K):
        best = tl.max(p, axis=0)
        idx = tl.min(tl.where(p == best, offs, BLOCK_E), axis=0)
        ids = tl.where(slots == j, idx.to(tl.int64), ids)
        weights = tl.where(slots == j, best, weights)
        p = tl.where(offs == idx, -1.0, p)   # probabilities are >= 0: never chosen again
    if RENORM:
        weights = weights / tl.sum(weights, axis=0)
    keep = slots < K
    tl.store(ids_ptr + token * K + slots, ids, mask=keep)
    tl.store(weights_ptr + token * K + slots, weights, mask=keep)


def softmax_topk_triton(logits: torch.Tensor, k: int, renormalize: bool) -> Routing:
    """layers/moe.py's softmax_topk: logits [T, E] -> Routing(ids [T, k] int64, weights [T, k] float32)."""
    tokens, experts = logits.shape
    logits = logits.float()
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    ids = torch.empty(tokens, k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(tokens, k, dtype=torch.float32, device=logits.device)
    if tokens:
        _softmax_topk_kernel[(tokens,)](logits, ids, weights, logits.stride(0), E=experts, K=k,
                                        BLOCK_E=triton.next_power_of_2(experts),
                                        BLOCK_K=max(2, triton.next_power_of_2(k)), RENORM=renormalize)
    return Routing(ids, weights)
