"""Token embedding and LM head, vocab-parallel: rank r of N holds rows [r * V_r, (r + 1) * V_r) of the table.

    V_r = ceil(vocab / N); the last rank's rows past the vocab are zero padding (never looked up, and their
    logits are cut off after the gather)

    embedding: each rank looks up the ids it holds (zeros for the others), then one all-reduce sums the rows
    lm_head:   each rank computes its V_r logits, an all-gather puts [T, N * V_r] on every rank, cut to [T, vocab]
               (every rank has the full logits: the sampler runs on rank 0, and a decode graph's argmax is the
               same on every rank, so the next step's tokens can be read from it on each)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kestrel.distributed.comm import SINGLE, TPGroup
from kestrel.errors import ModelLoadError
from kestrel.layers.linear import _copy_checked


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.rows_per_rank = -(-vocab_size // tp.size)
        self.vocab_start = tp.rank * self.rows_per_rank
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, name: str = "?") -> None:
        if self.tp.size == 1:
            _copy_checked(param, loaded, name)
            return
        if tuple(loaded.shape) != (self.vocab_size, param.shape[1]):
            raise ModelLoadError(f"tensor {name}: checkpoint shape {tuple(loaded.shape)} does not match the "
                                 f"expected {(self.vocab_size, param.shape[1])}")
        rows = loaded[self.vocab_start:self.vocab_start + self.rows_per_rank]
        param.data.zero_()
        param.data[:rows.shape[0]].copy_(rows)

    def gathered(self) -> VocabEmbedding:
        """The whole table as a one-rank embedding on this rank; with several ranks every rank must call it (one
        all-gather of the shards). A lookup in it needs no collective: what a module run on one rank alone uses
        (an EAGLE-3 drafter that shares the target's embedding drafts on rank 0 only: docs/speculative.md)."""
        if self.tp.size == 1:
            return self
        table = self.tp.all_gather_rows(self.weight.data)[:self.vocab_size]   # the last shard's padding cut
        with torch.device("meta"):   # no table allocated only to be replaced
            full = VocabEmbedding(self.vocab_size, self.weight.shape[1])
        full.weight = nn.Parameter(table, requires_grad=False)
        return full

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.rows_per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(out)


class LMHead(VocabEmbedding):
    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight)
        if self.tp.size == 1:
            return logits
        return self.tp.all_gather_last_dim(logits)[..., :self.vocab_size]
