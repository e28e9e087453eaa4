"""Prompt-lookup drafting: the vectorized search agrees with a plain-Python reading of the rule (the longest
suffix n-gram in [min_n, max_n] that occurred earlier; its latest occurrence followed by k tokens, else its
earliest; the up to k tokens after it)."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kestrel.speculative.ngram import NgramProposer, propose_ngram


def reference(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        ends = [e for e in range(n - 1, length - 1) if tokens[e - n + 1: e + 1] == tokens[length - n:]]
        if ends:
            with_k_after = [e for e in ends if length - 1 - e >= k]
            end = with_k_after[-1] if with_k_after else ends[0]
            return tokens[end + 1: end + 1 + k]
    return []


@settings(max_examples=400, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), max_size=60), k=st.integers(1, 8), min_n=st.integers(1, 4),
       extra=st.integers(0, 3))
def test_matches_the_reference_on_random_small_vocab_sequences(tokens, k, min_n, extra):
    got = propose_ngram(np.array(tokens, dtype=np.int64), k, min_n, min_n + extra)
    assert got.tolist() == reference(tokens, k, min_n, min_n + extra)


def test_longest_ngram_wins_over_a_later_shorter_one():
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 7, 9, 2, 3, 8, 1, 2, 3]
    # "1 2 3" occurred at 0 (then 7 9); only "2 3" occurred later, at 5 (then 8)
    assert propose_ngram(np.array(tokens), 2, 2, 3).tolist() == [7, 9]
    assert propose_ngram(np.array(tokens), 2, 2, 2).tolist() == [8, 1]   # n = 2: latest occurrence with 2 after


def test_latest_occurrence_followed_by_k_tokens_is_taken():
    tokens = [5, 6, 1, 5, 6, 2, 3, 5, 6, 4, 0, 5, 6]
    # "5 6" ends at 1, 4 and 8
    assert propose_ngram(np.array(tokens), 3, 2, 2).tolist() == [4, 0, 5]         # the latest, 4 tokens after it
    assert propose_ngram(np.array(tokens), 5, 2, 2).tolist() == [2, 3, 5, 6, 4]   # the latest with 5 after


def test_short_period_repetition_drafts_k_tokens():
    assert propose_ngram(np.array([7, 7, 7, 7]), 3, 1, 2).tolist() == [7, 7]       # earliest: 2 tokens remain
    assert propose_ngram(np.array([3] + [7] * 10), 3, 1, 4).tolist() == [7, 7, 7]


def test_fewer_than_k_tokens_when_the_context_ends():
    assert propose_ngram(np.array([1, 2, 9, 1, 2]), 5, 2, 2).tolist() == [9, 1, 2]


def test_no_match_gives_an_empty_draft():
    assert propose_ngram(np.array([1, 2, 3, 4, 5]), 3, 1, 4).tolist() == []
    assert propose_ngram(np.array([1, 2, 3, 1, 4]), 3, 2, 4).tolist() == []   # only a 1-gram repeats


def test_sequences_too_short_to_hold_an_earlier_occurrence():
    for tokens in ([], [4], [4, 4]):
        assert propose_ngram(np.array(tokens, dtype=np.int64), 3, 2, 3).tolist() == []
    assert propose_ngram(np.array([4, 4]), 3, 1, 3).tolist() == [4]


def test_min_n_equal_to_max_n_matches_exactly_that_length():
    tokens = np.array([1, 2, 3, 8, 0, 2, 3])
    assert propose_ngram(tokens, 2, 2, 2).tolist() == [8, 0]
    assert propose_ngram(tokens, 2, 3, 3).tolist() == []


def test_only_the_window_is_searched():
    tokens = np.array([1, 2, 5] + [9, 8, 7, 6] * 3 + [1, 2])
    assert propose_ngram(tokens, 1, 2, 2).tolist() == [5]
    assert propose_ngram(tokens, 1, 2, 2, window=14).tolist() == []


def test_the_batch_proposer_drafts_each_sequence_with_its_own_k():
    proposer = NgramProposer(min_n=2, max_n=3)
    drafts = proposer.propose([[1, 2, 3, 4, 1, 2], np.array([5, 6, 7]), [8, 9, 1, 8, 9]], [2, 3, 1])
    assert drafts == [[3, 4], [], [1]]
