"""The adaptive depth policy (speculative/adaptive.py): it speculates where the measured goodput says so, stops
where verification costs more than the accepted tokens give back, and comes back when acceptance does."""
from __future__ import annotations

from kestrel.speculative.adaptive import DepthPolicy, bucket_of, expected_tokens

K = 3


def feed(policy: DepthPolicy, seq_ids: list[int], rate: float, step_s: dict[int, float], steps: int) -> list[int]:
    """Run `steps` steps: each chosen depth costs step_s[depth] and every draft position passes with `rate`
    (deterministically: the expected run, rounded down). Returns the depths chosen."""
    chosen = []
    for _ in range(steps):
        depth, per_seq = policy.choose(seq_ids, [K] * len(seq_ids))
        chosen.append(depth)
        policy.record_step(len(seq_ids), depth, step_s[depth])
        for seq_id, k in zip(seq_ids, per_seq):
            accepted = 0
            while accepted < k and rate ** (accepted + 1) >= 0.5:
                accepted += 1
            policy.record_acceptance(seq_id, k, accepted)
    return chosen


def test_expected_tokens_and_buckets():
    assert expected_tokens(1.0, 3) == 4
    assert abs(expected_tokens(0.5, 3) - 1.875) < 1e-9
    assert [bucket_of(b) for b in (1, 2, 3, 4, 5, 9, 128)] == [1, 2, 4, 4, 8, 16, 128]


def test_measures_a_plain_step_first_then_speculates_when_it_pays():
    policy = DepthPolicy(K)
    times = {0: 5.0, 1: 6.0, 2: 6.5, 3: 7.0}   # memory-bound: drafts are cheap
    chosen = feed(policy, [0], rate=0.9, step_s=times, steps=30)
    assert chosen[0] == 0
    assert chosen[-10:] == [K] * 10


def test_stops_when_acceptance_does_not_pay_for_the_step():
    policy = DepthPolicy(K)
    times = {0: 5.0, 1: 8.0, 2: 9.0, 3: 10.0}
    chosen = feed(policy, [0], rate=0.1, step_s=times, steps=60)   # drafts never pass
    assert chosen[-20:].count(0) >= 18   # off, except the occasional probe


def test_large_batches_decode_plainly_once_measured():
    policy = DepthPolicy(K)
    seqs = list(range(128))
    times = {0: 17.0, 1: 40.0, 2: 60.0, 3: 80.0}   # compute-bound: each draft costs a batch's worth of tokens
    chosen = feed(policy, seqs, rate=0.8, step_s=times, steps=40)
    assert sum(1 for d in chosen if d > 0) <= 3   # at most a few tries
    assert chosen[-20:] == [0] * 20


def test_an_unmeasured_depth_is_estimated_between_measured_ones():
    policy = DepthPolicy(K)
    policy.record_step(1, 0, 5.0)
    policy.record_step(1, 3, 11.0)
    assert policy._estimate(1, 1, 5.0) == 7.0 and policy._estimate(1, 2, 5.0) == 9.0


def test_a_request_comes_back_when_its_text_turns_predictable():
    policy = DepthPolicy(K)
    times = {0: 5.0, 1: 6.0, 2: 6.5, 3: 7.0}
    feed(policy, [0], rate=0.05, step_s=times, steps=60)
    assert policy.choose([0], [K])[0] == 0 or policy.seqs[0].steps_off == 0   # off (or probing)
    chosen = feed(policy, [0], rate=0.95, step_s=times, steps=80)
    assert chosen[-10:] == [K] * 10


def test_fixed_depth_when_adaptive_is_off():
    policy = DepthPolicy(K, adaptive=False)
    assert policy.choose([0, 1], [K, 1]) == (K, [K, 1])
