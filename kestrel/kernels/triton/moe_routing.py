"""Softmax top-k routing (Qwen3-MoE, Mixtral) in one launch: layers/moe.py's `softmax_topk` is four (softmax, top-k,
sum, divide), and at decode each is a launch of a few microseconds on a few hundred numbers, 48 layers a step.

One program a token: its E float32 logits in registers, softmax, then k rounds of "take the largest, mask it"
(the first index on ties), the k weights renormalised if asked. Same contract and the same order as the reference
(k largest, descending); exp is Triton's, so weights agree to float32 rounding and a choice between two experts
whose probabilities tie to the last bit may differ, as between any two softmax implementations.

The router GEMV before it (layers/moe.py's Router: F.linear(x.float(), W) with W [E, H] float32) is three launches
at decode through torch (the bf16 -> float32 copy of x, cuBLAS's float32 dot_kernel and its reduce_1Block_kernel:
~7 us a layer in the s22 H100 profile). `router_softmax_topk_triton` makes it one (`_router_logits_kernel`), for
decode-sized batches:

    grid (T, E / BLOCK_E): program (t, j) reads x[t] (bf16, widened in registers: exact) and W rows
    [j BLOCK_E, (j+1) BLOCK_E) (float32) along H, products in [BLOCK_E, BLOCK_H] float32 registers, one lane sum
    -> logits[t, j BLOCK_E:(j+1) BLOCK_E] (float32), then _softmax_topk_kernel as above

Every token re-reads W (1 MB at Qwen3-30B-A3B's 128 x 2048), from L2 after the first: fine for a handful of
tokens, not for prefill, so past ROUTER_GEMV_MAX_TOKENS tokens the logits come from F.linear (cuBLAS). The sums
are float32 in a different order than cuBLAS's: logits agree to float32 rounding (the same caveat as exp's).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kestrel.kernels.triton.pdl import launch_options, pdl_wait
from kestrel.kernels.routing import Routing


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


ROUTER_GEMV_MAX_TOKENS = 16   # tokens up to which the router GEMV is _router_logits_kernel (decode), else cuBLAS


@triton.jit
def _router_logits_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_w, stride_o, H: tl.constexpr, E: tl.constexpr,
                          BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, USE_PDL: tl.constexpr):
    """logits[t, experts] = x[t] @ W[experts].T in float32 (module docstring). Under PDL the first weight step
    (at Qwen3-30B-A3B's H the program's whole slice) is read before the wait, while the norm before it finishes."""
    token = tl.program_id(0).to(tl.int64)
    experts = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    e_ok = experts < E
    w_rows = w_ptr + experts[:, None].to(tl.int64) * stride_w
    first = tl.load(w_rows + tl.arange(0, BLOCK_H)[None, :],
                    mask=e_ok[:, None] & (tl.arange(0, BLOCK_H) < H)[None, :], other=0.0)
    pdl_wait(USE_PDL)
    acc = tl.zeros([BLOCK_E, BLOCK_H], dtype=tl.float32)
    for h0 in tl.static_range(0, H, BLOCK_H):
        hs = h0 + tl.arange(0, BLOCK_H)
        h_ok = hs < H
        if h0 == 0:
            w = first.to(tl.float32)
        else:
            w = tl.load(w_rows + hs[None, :], mask=e_ok[:, None] & h_ok[None, :], other=0.0).to(tl.float32)
        a = tl.load(x_ptr + token * stride_x + hs, mask=h_ok, other=0.0).to(tl.float32)
        acc += w * a[None, :]
    tl.store(out_ptr + token * stride_o + experts, tl.sum(acc, axis=1), mask=e_ok)


def router_logits_triton(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Router(x)'s logits, F.linear(x.float(), weight): x [T, H] (any float dtype), weight [E, H] float32 ->
    [T, E] float32, one launch."""
    tokens, hidden = x.shape
    experts = weight.shape[0]
    if x.stride(1) != 1:
        x = x.contiguous()
    weight = weight.contiguous()
    logits = torch.empty(tokens, experts, dtype=torch.float32, device=x.device)
    if tokens:
        # compiled: 2 experts a program (Qwen3-30B-A3B: 64 programs of 16 KB, the whole of H in one step);
        # interpreted: small, so the tests' shapes span several blocks and steps
        block_e, block_h = (4, 32) if _interpreted() else (2, min(triton.next_power_of_2(hidden), 2048))
        _router_logits_kernel[(tokens, triton.cdiv(experts, block_e))](
            x, weight, logits, x.stride(0), weight.stride(0), logits.stride(0), H=hidden, E=experts,
            BLOCK_E=block_e, BLOCK_H=block_h, num_warps=4, **launch_options(x.device))
    return logits


def router_softmax_topk_triton(x: torch.Tensor, weight: torch.Tensor, k: int, renormalize: bool) -> Routing:
    """softmax_topk(F.linear(x.float(), weight), k, renormalize) from the hidden states: two launches at decode
    (router GEMV, softmax top-k), cuBLAS's GEMV past ROUTER_GEMV_MAX_TOKENS tokens."""
    if x.shape[0] <= ROUTER_GEMV_MAX_TOKENS:
        logits = router_logits_triton(x, weight)
    else:
        logits = F.linear(x.float(), weight)
    return softmax_topk_triton(logits, k, renormalize)


# the seam for models whose routing is LayerOps.softmax_topk (models/llama_moe.py): where that is this module's
# kernel, routing can start from the hidden states and fold the router GEMV in too
softmax_topk_triton.from_hidden = router_softmax_topk_triton   # type: ignore[attr-defined]


def _interpreted() -> bool:
    return bool(triton.knobs.runtime.interpret)
