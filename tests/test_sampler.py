"""Sampling: greedy, seeded reproducibility, top-k / top-p / min-p support and mass."""
from __future__ import annotations

import torch

from kestrel.forward.sampler import apply_top_k_top_p_min_p, make_sampling_batch, sample


def batch(rows: int, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, generators=None):
    return make_sampling_batch([temperature] * rows, [top_k] * rows, [top_p] * rows, [min_p] * rows,
                               generators or [None] * rows, 0, torch.device("cpu"))


def test_greedy_is_argmax():
    logits = torch.randn(5, 50)
    assert torch.equal(sample(logits, batch(5, temperature=0.0)), logits.argmax(-1))


def test_same_seed_same_samples_different_seed_different():
    logits = torch.zeros(1, 1000)

    def draw(seed: int) -> list[int]:
        g = torch.Generator().manual_seed(seed)
        return [sample(logits, batch(1, generators=[g])).item() for _ in range(20)]

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


def test_top_k_keeps_only_k_tokens():
    logits = torch.randn(3, 100)
    masked = apply_top_k_top_p_min_p(logits, batch(3, top_k=5))
    kept = torch.isfinite(masked)
    assert kept.sum(-1).tolist() == [5, 5, 5]
    assert torch.equal(kept, torch.zeros_like(kept).scatter(-1, logits.topk(5).indices, True))


def test_top_p_keeps_smallest_set_reaching_mass():
    probs = torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04]])
    masked = apply_top_k_top_p_min_p(probs.log(), batch(1, top_p=0.85))
    assert torch.isfinite(masked).tolist() == [[True, True, True, False, False]]   # 0.5 + 0.3 < 0.85 <= 0.9


def test_min_p_drops_tokens_below_fraction_of_max():
    probs = torch.tensor([[0.6, 0.3, 0.05, 0.05]])
    masked = apply_top_k_top_p_min_p(probs.log(), batch(1, min_p=0.2))
    assert torch.isfinite(masked).tolist() == [[True, True, False, False]]


def test_sampled_frequencies_follow_the_truncated_distribution():
    probs = torch.tensor([0.5, 0.3, 0.1, 0.06, 0.04])
    logits = probs.log().expand(20000, 5).contiguous()
    g = [None] * 20000
    torch.manual_seed(0)
    tokens = sample(logits, make_sampling_batch([1.0] * 20000, [2] * 20000, [1.0] * 20000, [0.0] * 20000, g, 0,
                                                torch.device("cpu")))
    freq = torch.bincount(tokens, minlength=5).float() / 20000
    assert freq[2:].sum() == 0                               # top-k=2 removed the tail
    assert abs(freq[0] - 0.5 / 0.8) < 0.02                   # renormalised over the kept mass
