"""The draft vocabulary: the target tokens the drafter can propose, the most frequent on loss-bearing positions.

A smaller lm_head makes each drafting step cheaper; tokens outside it are never drafted, so it keeps the ones
the target actually produces. Stored as the standard checkpoint does:

    draft id i  <->  target id draft_ids[i]      d2t[i] = draft_ids[i] - i      t2d[j] = j is some draft_ids[i]
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from kestrel.train.data import Sample


def token_counts(samples: Iterable[Sample], vocab_size: int) -> torch.Tensor:
    """How often each target token appears among the answers' tokens (the positions the drafter must predict)."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for s in samples:
        ids = torch.tensor(s.token_ids[s.num_prompt_tokens:], dtype=torch.int64)
        counts += torch.bincount(ids, minlength=vocab_size)[:vocab_size]
    return counts


def select_draft_vocab(counts: torch.Tensor, draft_vocab_size: int) -> torch.Tensor:
    """The draft_vocab_size most frequent target ids, ascending (ties: the lower id first, so it is deterministic);
    ids never seen fill the remainder in id order."""
    vocab = counts.numel()
    size = min(draft_vocab_size, vocab)
    # a stable sort on -count keeps id order among equal counts
    order = torch.sort(-counts, stable=True).indices
    return order[:size].sort().values


def coverage(counts: torch.Tensor, draft_ids: torch.Tensor) -> float:
    """The share of answer tokens the draft vocabulary holds: an upper bound on any draft's acceptance."""
    total = int(counts.sum())
    return float(counts[draft_ids].sum()) / total if total else 0.0
