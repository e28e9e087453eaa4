"""One sequence's place in its grammar, and the token bitmasks the sampler applies.

A bitmask row is ceil(vocab / 32) int32 words; bit j of word w allows token 32 * w + j:

    bitmask[r]:  [ word 0: tokens 0..31 | word 1: tokens 32..63 | ... ]    (forward/sampler.py unpacks it)

The matcher advances only through committed tokens (engine/commit.py). A verify step needs a mask at every draft
position: the matcher walks each draft path, fills that row, and rolls back, so it is where it started afterwards.
"""
from __future__ import annotations

import logging
from concurrent.futures import Future

import torch

logger = logging.getLogger("kestrel.structured")


class SequenceGrammar:
    """A sequence's matcher, made when its compiled grammar is first needed (compiling overlaps the prefill)."""

    def __init__(self, compiled: Future) -> None:
        self._compiled = compiled
        self._matcher = None

    @property
    def matcher(self):
        if self._matcher is None:
            import xgrammar as xgr

            self._matcher = xgr.GrammarMatcher(self._compiled.result())
        return self._matcher

    def accept(self, token: int) -> bool:
        """Advance past a committed token; False when the grammar forbids it (then nothing changes)."""
        return self.matcher.accept_token(token)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: nothing may follow."""
        return self.matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """The tokens allowed next, into bitmask[row]."""
        m = self.matcher
        if m.is_terminated():
            bitmask[row].fill_(-1)   # never sampled from (the sequence has finished): anything, but not nothing
        else:
            m.fill_next_token_bitmask(bitmask, row)

    def fill_along(self, bitmask: torch.Tensor, rows: list[int], paths: list[list[int]]) -> None:
        """bitmask[rows[i]]: the tokens allowed after paths[i] (tokens past the committed ones: drafts). A path the
        grammar rejects gets a row allowing everything: its draft is masked at the row before, so verification
        rejects it there and never draws from this row (which must still not be all -inf)."""
        m = self.matcher
        for row, path in zip(rows, paths):
            accepted = 0
            for token in path:
                if m.is_terminated() or not m.accept_token(token):
                    break
                accepted += 1
            if accepted == len(path):
                self.fill(bitmask, row)
            else:
                bitmask[row].fill_(-1)
            if accepted:
                m.rollback(accepted)


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """[rows, ceil(vocab / 32)] int32 on the host, every token allowed (-1: all bits set)."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def plain_bitmask(grammars: list[SequenceGrammar | None], vocab_size: int,
                  batch=None) -> tuple[torch.Tensor, list[int]] | None:
    """A plain step's masks: (bitmask, the rows it masks) for the rows with a grammar, None when no row has one.
    batch: an xgrammar BatchGrammarMatcher, which fills the rows on its C++ threads (the GIL released) instead of one
    after another here: at 32 rows of a 128k vocabulary that is a third less host time, overlapping the device."""
    rows = [i for i, g in enumerate(grammars) if g is not None]
    if not rows:
        return None
    bitmask = allocate_bitmask(len(rows), vocab_size)   # a terminated grammar's row stays all-allowed
    live = [k for k, i in enumerate(rows) if not grammars[i].is_terminated]
    if batch is not None and len(live) > 1:
        batch.batch_fill_next_token_bitmask([grammars[rows[k]].matcher for k in live], bitmask, live)
    else:
        for k in live:
            grammars[rows[k]].fill(bitmask, k)
    return bitmask, rows
