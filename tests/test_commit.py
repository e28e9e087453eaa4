"""The one commit path (engine/commit.py): a plain step's token, an overlapped step's token written over its
placeholder and a verify step's accepted run reach a sequence the same way, so the same tokens give the same
SampleUpdates, stops, logprobs, counters and finished-request bookkeeping whichever step made them."""
from __future__ import annotations

import pytest

from kestrel.cache.block_pool import BlockPool
from kestrel.cache.radix import NoPrefixCache
from kestrel.engine.commit import Committer
from kestrel.engine.messages import TokenLogprob
from kestrel.engine.overlap import PLACEHOLDER
from kestrel.engine.request import Sequence
from kestrel.engine.scheduler import Scheduler
from kestrel.sampling_params import SamplingParams

EOS, STOP = 2, 7
PROMPT = [11, 12, 13, 14, 15, 16]
MAX_MODEL_LEN = 16
TOKENS = [20, 21, STOP, 22, EOS, 23, 24, 25, 26, 27]   # what the model "produces", in order


def setup(params: SamplingParams, n: int = 1) -> tuple[Committer, list[Sequence], list[int]]:
    scheduler = Scheduler(BlockPool(64, 4), NoPrefixCache(), max_num_seqs=8, max_num_batched_tokens=64)
    seqs = [Sequence(i, "r", i, list(PROMPT), params) for i in range(n)]
    committer = Committer(scheduler, {"r": seqs}, frozenset({EOS}), MAX_MODEL_LEN)
    forgotten: list[int] = []
    committer.on_forget = forgotten.append
    for seq in seqs:
        scheduler.add(seq)
    scheduler.schedule()   # admitted: running, blocks for the prompt
    for seq in seqs:
        seq.num_computed_tokens = seq.num_tokens   # the prefill ran
    return committer, seqs, forgotten


def logprob(token: int) -> TokenLogprob:
    return TokenLogprob(token, -0.5, [(token, -0.5)])


def plain_steps(committer: Committer, seq: Sequence) -> list:
    """One sampled token a step (the step marked its chunk computed before sampling)."""
    updates = []
    for i, token in enumerate(TOKENS):
        seq.num_computed_tokens = seq.num_tokens
        updates.append(committer.commit(seq, [token], [logprob(token)], now=float(i)))
        if seq.is_finished:
            break
    return updates


def overlapped_steps(committer: Committer, seq: Sequence) -> list:
    """Each launch leaves a placeholder; a step's token is committed over it after the next step launched."""
    updates, launched = [], None
    for i, token in enumerate(TOKENS):
        seq.num_computed_tokens = seq.num_tokens
        position = len(seq.output_token_ids)
        seq.output_token_ids.append(PLACEHOLDER)
        if launched is not None:
            at, earlier = launched
            updates.append(committer.commit(seq, [earlier], [logprob(earlier)], now=float(i - 1), at=at))
            if seq.is_finished:
                return updates
        launched = (position, token)
    at, last = launched
    updates.append(committer.commit(seq, [last], [logprob(last)], now=float(len(TOKENS)), at=at))
    return updates


def verify_steps(committer: Committer, seq: Sequence, run: int = 4) -> list:
    """The prefill's token, then verify steps that each accept `run` tokens (drafts and the target's own)."""
    seq.num_computed_tokens = seq.num_tokens
    updates = [committer.commit(seq, TOKENS[:1], [logprob(TOKENS[0])], now=0.0)]
    at = 1
    while not seq.is_finished and at < len(TOKENS):
        assert seq.num_computed_tokens == seq.num_tokens - 1   # a decode: every token but the last is computed
        new = TOKENS[at:at + run]
        updates.append(committer.commit(seq, new, [logprob(t) for t in new], now=float(at), verified=True))
        at += run
    return updates


def fields(updates: list) -> tuple:
    """What the steps reported, whatever their number: the tokens and logprobs in order, and how it ended."""
    tokens = [t for u in updates for t in u.new_token_ids]
    logprobs = [lp for u in updates for lp in (u.new_logprobs or [])]
    last = updates[-1]
    return tokens, logprobs, last.finished, last.finish_reason, {(u.num_prompt_tokens, u.num_cached_tokens)
                                                                 for u in updates}


@pytest.mark.parametrize("params, tokens, reason", [
    (SamplingParams(max_tokens=10, stop_token_ids=[STOP]), TOKENS[:3], "stop"),
    (SamplingParams(max_tokens=10, stop_token_ids=[STOP], min_tokens=4), TOKENS[:5], "stop"),     # EOS after
    (SamplingParams(max_tokens=10, stop_token_ids=[STOP], min_tokens=4, ignore_eos=True), TOKENS[:10], "length"),
    (SamplingParams(max_tokens=6, ignore_eos=True), TOKENS[:6], "length"),
    (SamplingParams(max_tokens=None, ignore_eos=True), TOKENS[:MAX_MODEL_LEN - len(PROMPT)], "length"),
])
def test_plain_overlapped_and_verified_tokens_commit_alike(params, tokens, reason):
    results = []
    for steps in (plain_steps, overlapped_steps, verify_steps):
        committer, (seq,), forgotten = setup(params)
        updates = steps(committer, seq)
        got = fields(updates)
        assert got[0] == tokens and got[2] and got[3] == reason, steps.__name__
        assert [lp.token_id for lp in got[1]] == tokens   # a verify step reports the kept tokens' logprobs only
        assert seq.output_token_ids == tokens             # the overlap's later placeholder was dropped
        assert committer.generation_tokens_total == len(tokens)
        assert seq.first_token_time == 0.0
        assert committer.requests == {} and forgotten == [seq.seq_id]
        assert not seq.block_ids and seq.num_computed_tokens <= seq.num_tokens
        results.append(got)
    assert results[0] == results[1] == results[2]


def test_a_request_is_forgotten_once_all_its_samples_finished():
    committer, (a, b), forgotten = setup(SamplingParams(max_tokens=2, ignore_eos=True, n=2), n=2)
    committer.commit(a, [20, 21], None, now=0.0, verified=True)
    assert a.is_finished and "r" in committer.requests and forgotten == []
    update = committer.finish(b, "abort")   # between steps: no tokens
    assert (update.new_token_ids, update.finished, update.finish_reason) == ([], True, "abort")
    assert committer.requests == {} and forgotten == [a.seq_id, b.seq_id]


def test_min_tokens_masks_stops_per_row_depth():
    import torch

    committer, (seq,), _ = setup(SamplingParams(max_tokens=10, stop_token_ids=[STOP], min_tokens=2))
    seq.output_token_ids.append(20)   # one output: the next token is the 2nd, the one after it the 3rd
    logits = torch.zeros(3, 30)
    assert committer.mask_stops_under_min_tokens([seq], logits, range(3))
    banned = logits[:, [STOP, EOS]].isinf().all(dim=1).tolist()
    assert banned == [True, False, False]   # only the row drawing output 2 is still under min_tokens
    assert not committer.mask_stops_under_min_tokens([seq], torch.zeros(1, 30), [1])
