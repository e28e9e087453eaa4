"""The fused logits cast + argmax (kestrel/kernels/triton/logits_argmax.py) against torch's `.float()` and
`torch.argmax`, run on CPU by Triton's interpreter: first index of the maximum across chunk boundaries, ties,
NaN, several rows, and the counters left at zero for the next launch (as a graph replay needs)."""
from __future__ import annotations

import pytest
import torch

from tests.triton_interpreter import INTERPRETED, interpreted_only, run_file_under_interpreter

interpreted = interpreted_only("test_logits_argmax_under_triton_interpreter")


@pytest.mark.slow   # a child pytest running the file's kernels in Triton's interpreter
@pytest.mark.skipif(INTERPRETED, reason="this is the interpreter child")
def test_logits_argmax_under_triton_interpreter():
    run_file_under_interpreter(__file__, min_passed=6)   # all but the ones that skip in the child


def _check(logits: torch.Tensor, scratch) -> None:
    from kestrel.kernels.triton.logits_argmax import logits_argmax
    tokens = torch.full((logits.shape[0],), -1, dtype=torch.int64)
    out = logits_argmax(logits, tokens, scratch)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, logits.float(), rtol=0, atol=0, equal_nan=True)   # a copy: bit-exact
    assert tokens.tolist() == torch.argmax(logits.float(), dim=-1).tolist()
    assert torch.count_nonzero(scratch[2]) == 0, f"counters left at {scratch[2].tolist()}"


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_matches_torch_over_several_chunks_and_rows(dtype):
    from kestrel.kernels.triton.logits_argmax import BLOCK, alloc_argmax_scratch
    gen = torch.Generator().manual_seed(3)
    vocab = 3 * BLOCK + 123   # four chunks, the last one short
    scratch = alloc_argmax_scratch(6, torch.device("cpu"))
    for rows in (1, 5, 3):    # the same scratch each time, like graph replays
        _check((torch.randn(rows, vocab, generator=gen) * 4).to(dtype), scratch)


@interpreted
def test_ties_go_to_the_first_index_across_and_inside_chunks():
    from kestrel.kernels.triton.logits_argmax import BLOCK, alloc_argmax_scratch
    vocab = 2 * BLOCK + 10
    logits = torch.zeros(4, vocab, dtype=torch.bfloat16)
    logits[0, [BLOCK + 5, 7, 2 * BLOCK + 1]] = 3.0          # the maximum in three chunks: index 7 wins
    logits[1, [BLOCK + 9, BLOCK + 3]] = 2.0                  # twice in one chunk: BLOCK + 3
    logits[2, :] = float("-inf")                             # all -inf: index 0, as torch
    logits[3, [BLOCK + 1, 2 * BLOCK + 2]] = float("nan")     # NaN ranks above everything: the first NaN
    _check(logits, alloc_argmax_scratch(4, torch.device("cpu")))


@interpreted
def test_refuses_a_vocabulary_beyond_its_chunks():
    from kestrel.kernels.triton.logits_argmax import BLOCK, MAX_CHUNKS, alloc_argmax_scratch, logits_argmax
    logits = torch.zeros(1, MAX_CHUNKS * BLOCK + 1)
    with pytest.raises(AssertionError, match="vocabulary"):
        logits_argmax(logits, torch.zeros(1, dtype=torch.int64), alloc_argmax_scratch(1, torch.device("cpu")))


@interpreted
def test_writes_into_rows_of_a_shared_buffer():
    from kestrel.kernels.triton.logits_argmax import BLOCK, alloc_argmax_scratch, logits_argmax
    vocab = 2 * BLOCK + 7
    shared = torch.full((6, vocab), float("nan"))   # as DecodeGraphs' buffer: each launch writes its first rows
    scratch = alloc_argmax_scratch(6, torch.device("cpu"))
    for rows in (6, 2):
        logits = torch.randn(rows, vocab).to(torch.bfloat16)
        tokens = torch.zeros(rows, dtype=torch.int64)
        out = logits_argmax(logits, tokens, scratch, shared[:rows])
        assert out.data_ptr() == shared.data_ptr()
        torch.testing.assert_close(shared[:rows], logits.float(), rtol=0, atol=0)
        assert tokens.tolist() == torch.argmax(logits.float(), dim=-1).tolist()
