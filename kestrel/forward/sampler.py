"""Sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds, optional top logprobs.

Works on a whole batch of rows at once and returns device tensors; the engine reads them back once per step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kestrel.sampling_params import GREEDY_TEMPERATURE


@dataclass(slots=True)
class SamplingBatch:
    """Per-row sampling settings, as tensors on the logits' device."""
    temperature: torch.Tensor          # [B] float32; <= GREEDY_TEMPERATURE = greedy
    top_k: torch.Tensor                # [B] int64; 0 = off
    top_p: torch.Tensor                # [B] float32; 1 = off
    min_p: torch.Tensor                # [B] float32; 0 = off
    generators: list[torch.Generator | None]   # seeded rows draw from their own generator
    all_greedy: bool
    needs_top_k: bool
    needs_top_p: bool
    needs_min_p: bool
    max_logprobs: int                  # 0: no logprobs wanted this step


def make_sampling_batch(temperatures: list[float], top_ks: list[int], top_ps: list[float], min_ps: list[float],
                        generators: list[torch.Generator | None], max_logprobs: int,
                        device: torch.device) -> SamplingBatch:
    # One host-to-device copy for all four settings (each copy costs tens of microseconds on a slow host).
    packed = torch.tensor([temperatures, [float(max(k, 0)) for k in top_ks], top_ps, min_ps],
                          dtype=torch.float32).to(device, non_blocking=True)
    return SamplingBatch(
        temperature=packed[0],
        top_k=packed[1].long(),   # exact: top-k values are small integers
        top_p=packed[2],
        min_p=packed[3],
        generators=generators,
        all_greedy=all(t <= GREEDY_TEMPERATURE for t in temperatures),
        needs_top_k=any(k > 0 for k in top_ks),
        needs_top_p=any(p < 1.0 for p in top_ps),
        needs_min_p=any(p > 0.0 for p in min_ps),
        max_logprobs=max_logprobs,
    )


def apply_top_k_top_p_min_p(logits: torch.Tensor, s: SamplingBatch) -> torch.Tensor:
    """Mask (to -inf) every token outside the top-k / nucleus / min-p set of its row."""
    if s.needs_top_k or s.needs_top_p:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        vocab = logits.shape[-1]
        ranks = torch.arange(vocab, device=logits.device).expand_as(sorted_logits)
        drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
        if s.needs_top_k:
            k = torch.where(s.top_k > 0, s.top_k, vocab)
            drop |= ranks >= k[:, None]
        if s.needs_top_p:
            probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
            # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass before it already does.
            mass_before = probs.cumsum(dim=-1) - probs
            drop |= mass_before >= s.top_p[:, None]
            drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    if s.needs_min_p:
        probs = logits.softmax(dim=-1)
        threshold = probs.max(dim=-1, keepdim=True).values * s.min_p[:, None]
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def sample(logits: torch.Tensor, s: SamplingBatch) -> torch.Tensor:
    """logits [B, V] float32 -> token ids [B] int64 (on the logits' device)."""
    greedy_tokens = logits.argmax(dim=-1)
    if s.all_greedy:
        return greedy_tokens
    temperature = torch.where(s.temperature > GREEDY_TEMPERATURE, s.temperature, torch.ones_like(s.temperature))
    scaled = apply_top_k_top_p_min_p(logits / temperature[:, None], s)
    probs = scaled.softmax(dim=-1)
    # Gumbel-style sampling without a host sync: argmax(p / E) with E ~ Exponential(1) draws from p.
    noise = torch.empty_like(probs).exponential_()
    for row, gen in enumerate(s.generators):
        if gen is not None:
            noise[row].exponential_(generator=gen)
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(s.temperature > GREEDY_TEMPERATURE, sampled, greedy_tokens)


def top_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probabilities of the model's distribution: (chosen [B], top values [B, k], top ids [B, k])."""
    logprobs = logits.log_softmax(dim=-1)
    chosen = logprobs.gather(-1, tokens[:, None]).squeeze(-1)
    values, ids = logprobs.topk(max(k, 1), dim=-1)
    return chosen, values, ids


_BITS = {}   # device -> arange(32) as int32: the bit positions of a bitmask word


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Constrained decoding (kestrel/structured/): forbid, in place, the tokens a grammar does not allow next.
    bitmask [len(rows), ceil(V / 32)] int32 (bit j of word w allows token 32 w + j) masks logits row rows[i];
    every other row is untouched. Runs after the model step (outside its CUDA graph), before sampling."""
    device = logits.device
    bits = _BITS.get(device)
    if bits is None:
        bits = _BITS[device] = torch.arange(32, dtype=torch.int32, device=device)
    words = bitmask.to(device, non_blocking=True)
    allowed = ((words[:, :, None] >> bits) & 1).bool().flatten(1)        # [R, 32 * words]
    vocab = logits.shape[-1]
    if allowed.shape[1] < vocab:   # logits wider than the grammar's vocabulary: the padding is never allowed
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    index = torch.tensor(rows, device=device)
    logits[index] = logits.index_select(0, index).masked_fill(~allowed[:, :vocab], float("-inf"))
