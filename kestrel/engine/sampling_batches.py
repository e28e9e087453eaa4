"""The sequences' sampling settings as a SamplingBatch on the device: the one place the engine builds one.

Building one is a host-to-device copy. The steps that repeat the same rows step after step (a continuing overlap
launch, a bs1 stream of verify steps) reuse the last one through SamplingBatchCache: at bs1 that copy costs more
than the sampling or the verification itself.
"""
from __future__ import annotations

import torch

from kestrel.engine.request import Sequence
from kestrel.forward.sampler import SamplingBatch, make_sampling_batch


def sampling_batch(seqs: list[Sequence], max_logprobs: int, device: torch.device) -> SamplingBatch:
    """Row i samples as seqs[i] asks (its own generator when seeded); max_logprobs: the most top logprobs a row
    wants this step (0: none)."""
    params = [seq.params for seq in seqs]
    return make_sampling_batch([p.temperature for p in params], [p.top_k for p in params],
                               [p.top_p for p in params], [p.min_p for p in params],
                               [seq.generator for seq in seqs], max_logprobs, device)


class SamplingBatchCache:
    """The last batch built, kept while the same sequences (in the same order) ask with the same max_logprobs. A
    sequence's settings and generator never change and its id is never reused, so the ids identify the batch."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._key: tuple[tuple[int, ...], int] | None = None
        self._batch: SamplingBatch | None = None

    def get(self, seqs: list[Sequence], max_logprobs: int = 0) -> SamplingBatch:
        key = (tuple(seq.seq_id for seq in seqs), max_logprobs)
        if self._batch is None or self._key != key:
            self._batch = sampling_batch(seqs, max_logprobs, self.device)
            self._key = key
        return self._batch
