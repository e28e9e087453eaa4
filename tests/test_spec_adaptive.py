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
    for depth, seconds in ((0, 5.0), (3, 11.0)):
        policy.record_step(1, depth, 99.0)   # the switch's step: dropped
        policy.record_step(1, depth, seconds)
    assert policy._estimate(1, 1, 5.0) == 7.0 and policy._estimate(1, 2, 5.0) == 9.0


def feed_with_switch_cost(policy: DepthPolicy, rate: float, steady: dict[int, float], switch: float,
                          steps: int) -> list[int]:
    """One sequence; a step costs steady[depth], plus `switch` when its depth differs from the step before (the
    overlap schedule draining or refilling)."""
    chosen, last = [], None
    for _ in range(steps):
        depth, per_seq = policy.choose([0], [K])
        policy.record_step(1, depth, steady[depth] + (switch if depth != last else 0.0))
        last = depth
        chosen.append(depth)
        accepted = 0
        while accepted < per_seq[0] and rate ** (accepted + 1) >= 0.5:
            accepted += 1
        policy.record_acceptance(0, per_seq[0], accepted)
    return chosen


def test_a_plain_step_timed_between_verify_steps_does_not_keep_speculation_on():
    """A tiny model: a steady plain step costs 1, a verify step 5 for ~1.9 tokens, and a switch 4 more. A plain
    step timed right after a verify step (5 = 1 + 4) would make speculation look as cheap as decoding; the
    switch's step is dropped, so the policy settles on plain decoding."""
    chosen = feed_with_switch_cost(DepthPolicy(K), rate=0.6, steady={0: 1.0, 1: 3.0, 2: 4.0, 3: 5.0}, switch=4.0,
                                   steps=200)
    assert chosen[-100:].count(0) >= 95


def test_the_plain_step_is_measured_again_while_speculating():
    """While a bucket speculates its plain step is timed again every remeasure_every steps (a run of plain steps,
    the first dropped), so a plain step that became cheaper turns speculation off."""
    policy = DepthPolicy(K, remeasure_every=32)
    steady = {0: 5.0, 1: 5.5, 2: 6.0, 3: 6.5}
    chosen = feed_with_switch_cost(policy, rate=0.9, steady=steady, switch=1.0, steps=100)
    assert chosen[-40:].count(K) >= 34 and chosen[-40:].count(0) >= 2   # speculating, with re-measurements
    steady[0] = 1.0   # plain decoding got 5x cheaper (e.g. a stalled first measurement, now gone)
    chosen = feed_with_switch_cost(policy, rate=0.9, steady=steady, switch=1.0, steps=200)
    assert chosen[-50:].count(0) >= 45


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
