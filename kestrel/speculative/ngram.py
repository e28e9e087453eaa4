"""N-gram (prompt lookup) drafting: if the context's last n tokens occurred earlier, propose what followed them.

The rule, for one sequence `tokens` (prompt + output so far):
  - n is the longest length in [min_n, max_n] whose suffix tokens[-n:] also occurs ending before the last token
    (occurrences may overlap the suffix: in "a b a b a b" the suffix "a b" occurs at 0 and 2);
  - among the occurrences of that n-gram, take the latest one still followed by k tokens, else the earliest (which
    is followed by the most). The latest is the most relevant context; falling back to the earliest keeps a
    short-period repetition ("x x x x", period 1) drafting k tokens instead of the 1 the latest would give.
    (vLLM always takes the earliest occurrence.)
  - propose the up to k tokens that follow it; none if no n-gram matches.
Only the last `window` tokens are searched (vLLM searches the whole context): the cost per step is
O(window * max_n) numpy work per sequence, bounded however long the context grows.
"""
from __future__ import annotations

import numpy as np

from kestrel.speculative.proposer import DraftSource, Proposer

SEARCH_WINDOW = 8192   # tokens searched per sequence; ~0.1 ms of numpy at max_n = 4


def propose_ngram(tokens: np.ndarray, k: int, min_n: int, max_n: int, window: int = SEARCH_WINDOW) -> np.ndarray:
    """tokens [L] -> the draft [<= k], same dtype (empty when no n-gram of length min_n..max_n matches)."""
    t = np.asarray(tokens)[-window:]
    length = t.shape[0]
    max_n = min(max_n, length - 1)          # an earlier occurrence ends at length - 2 at the latest
    if k < 1 or max_n < min_n:
        return t[:0].copy()
    # run[e] = how many trailing tokens of t[:e + 1] equal the trailing tokens of t, capped at max_n: one pass per
    # n-gram position j, each comparing every candidate end e at once (t[e - j] against t[length - 1 - j]).
    num_ends = length - 1
    matching = np.ones(num_ends, dtype=bool)
    run = np.zeros(num_ends, dtype=np.int64)
    for j in range(max_n):
        matching[:j] = False                 # an occurrence of length j + 1 cannot end before position j
        matching[j:] &= t[: num_ends - j] == t[length - 1 - j]
        if not matching.any():
            break
        run += matching
    n = int(run.max())
    if n < min_n:
        return t[:0].copy()
    ends = np.flatnonzero(run == n)
    with_k_after = ends[ends <= length - 1 - k]
    end = with_k_after[-1] if with_k_after.size else ends[0]
    return t[end + 1: end + 1 + k].copy()


class NgramProposer(Proposer):
    """Drafts by prompt lookup (one numpy search per sequence)."""

    def __init__(self, min_n: int, max_n: int, window: int = SEARCH_WINDOW) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self.window = window

    def drafts(self, seq: DraftSource, k: int) -> list[int]:
        return propose_ngram(np.asarray(seq.token_ids(), dtype=np.int64), k, self.min_n, self.max_n,
                             self.window).tolist()

    def propose(self, token_lists: list[np.ndarray | list[int]], ks: list[int]) -> list[list[int]]:
        """Each sequence's tokens and how many drafts it may take -> its drafts (possibly fewer, or none)."""
        return [propose_ngram(np.asarray(tokens), k, self.min_n, self.max_n, self.window).tolist()
                for tokens, k in zip(token_lists, ks, strict=True)]
