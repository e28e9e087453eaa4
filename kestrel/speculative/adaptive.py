"""How many tokens to draft: per step from measured step times, per sequence from measured acceptance.

Speculation pays when the tokens a verify step yields outweigh what the step costs over a plain decode step:

    goodput(k) = sum over the batch's sequences of E_s(k)  /  T(batch, k)
    E_s(k)     = 1 + a_s + a_s^2 + ... + a_s^k      (a_s: the chance that sequence s's next draft is accepted,
                                                     given the ones before it were)

T(batch, k) is the measured wall time of a step of that batch-size bucket and depth (k = 0: a plain decode
step), an exponential moving average; a depth never measured in a bucket is estimated between the measured
depths around it (past the deepest, +10% of a plain step a draft) and tried once when that estimate says it
could beat the best measured depth. The depth with the highest goodput wins,
0 included, so at large batches (verification is compute-bound) and for requests that keep rejecting drafts the
engine decodes plainly. A step right after the depth changed is not timed: it pays for the switch (the overlap
schedule drains before a verify step and refills after it), so a plain step timed between two verify steps would
cost several steady plain steps and keep speculation on where it loses. For the same reason the plain step is
measured again, as a short run of plain steps, every `remeasure_every` steps of a bucket that speculates.
A sequence whose acceptance has fallen below `min_acceptance` stops drafting and is probed
again after `probe_every` steps, then after twice as many for each probe that fails (at most MAX_PROBE_GAP), so
it comes back when its text turns predictable and costs little while it does not.
"""
from __future__ import annotations

from dataclasses import dataclass, field

PRIOR_COST_PER_DRAFT = 0.10   # T(b, k) / T(b, 0) - 1 per draft before anything is measured
EMA = 0.2                     # weight of the newest measurement
MAX_PROBE_GAP = 512          # steps: a request that keeps rejecting is probed at least this often
PROBE_ACCEPTANCE = 0.7        # assumed for a request never measured, or probed again after it stopped drafting
PLAIN_RUN = 3                 # plain steps of a re-measurement: the first pays the switch, the others are timed


def bucket_of(batch_size: int) -> int:
    """Batch sizes that cost about the same share a timing: 1, 2, 4, 8, 16, 32, ..."""
    return 1 << max(0, batch_size - 1).bit_length()


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens one verify step of k drafts yields: the accepted run plus the target's own token."""
    return sum(acceptance ** j for j in range(k + 1))


@dataclass(slots=True)
class _SeqAcceptance:
    accepted: float = 0.0     # decayed counts of drafts accepted / drafts tried (a rejection ends a run)
    tried: float = 0.0
    steps_off: int = 0        # steps since it last drafted, while off
    probe_after: int = 0      # steps off before the next probe (0: the policy's probe_every); doubles per failed probe

    @property
    def rate(self) -> float:
        return self.accepted / self.tried if self.tried else PROBE_ACCEPTANCE   # a new request drafts


@dataclass
class DepthPolicy:
    max_depth: int
    adaptive: bool = True
    depths: tuple[int, ...] | None = None   # the depths a step may take (None: 0 .. max_depth); a tree: (0, K)
    min_acceptance: float = 0.2
    probe_every: int = 16
    remeasure_every: int = 64   # steps of a speculating bucket between two re-measurements of its plain step
    step_time: dict[tuple[int, int], float] = field(default_factory=dict)   # (bucket, depth) -> seconds
    seqs: dict[int, _SeqAcceptance] = field(default_factory=dict)
    _last_timed_depth: dict[int, int] = field(default_factory=dict)   # bucket -> depth of its last step recorded
    _since_plain: dict[int, int] = field(default_factory=dict)        # bucket -> steps since its plain step was timed
    _plain_run: dict[int, int] = field(default_factory=dict)          # bucket -> plain steps left to re-measure

    def choose(self, seq_ids: list[int], limits: list[int]) -> tuple[int, list[int]]:
        """(the step's depth, each sequence's number of drafts). limits[i] caps sequence i (tokens it may still
        produce); a sequence that does not draft this step gets 0. Depth 0: a plain decode step."""
        if not self.adaptive:
            per_seq = [min(self.max_depth, lim) for lim in limits]
            return max(per_seq, default=0), per_seq
        rates = []
        for seq_id, lim in zip(seq_ids, limits):
            s = self.seqs.setdefault(seq_id, _SeqAcceptance())
            rate = s.rate
            if rate < self.min_acceptance and s.steps_off >= (s.probe_after or self.probe_every):
                rate = PROBE_ACCEPTANCE   # a probe: draft as a new request would, to measure it again
            rates.append(rate if rate >= self.min_acceptance and lim > 0 else None)
        if all(r is None for r in rates):
            return 0, [0] * len(seq_ids)
        depth = self._best_depth(len(seq_ids), [r for r in rates if r is not None])
        return depth, [min(depth, lim) if r is not None else 0 for r, lim in zip(rates, limits)]

    def _best_depth(self, batch_size: int, rates: list[float]) -> int:
        b = bucket_of(batch_size)
        base = self.step_time.get((b, 0))
        if base is None:   # measure a plain step of this bucket first: every estimate is relative to it
            return 0
        if self._plain_run.get(b, 0) > 0:   # a re-measurement of the plain step is under way
            self._plain_run[b] -= 1
            return 0
        others = batch_size - len(rates)   # sequences in the step that do not draft: one token each
        best, best_goodput = 0, None
        for k in (self.depths if self.depths is not None else range(self.max_depth + 1)):
            estimate = self._estimate(b, k, base)
            goodput = (others + sum(expected_tokens(r, k) for r in rates)) / estimate
            if best_goodput is None or goodput > best_goodput:
                best, best_goodput = k, goodput
        if best > 0:
            self._since_plain[b] = self._since_plain.get(b, 0) + 1
            if self._since_plain[b] >= self.remeasure_every:
                self._since_plain[b] = 0
                self._plain_run[b] = PLAIN_RUN - 1
                return 0
        return best

    def _estimate(self, bucket: int, k: int, base: float) -> float:
        """T(bucket, k): measured, else interpolated between the nearest measured depths around k (a verify step
        costs a fixed drafter part plus a part that grows with k, so a line between measured depths is fair),
        else extrapolated from the deepest measured one with the prior slope."""
        measured = self.step_time.get((bucket, k))
        if measured is not None:
            return measured
        known = sorted((d, t) for (b, d), t in self.step_time.items() if b == bucket)
        below = max((x for x in known if x[0] < k), default=(0, base))
        above = min((x for x in known if x[0] > k), default=None)
        if above is None:
            return below[1] + base * PRIOR_COST_PER_DRAFT * (k - below[0])
        return below[1] + (above[1] - below[1]) * (k - below[0]) / (above[0] - below[0])

    # ---- measurements --------------------------------------------------------------------------------------
    def record_step(self, batch_size: int, depth: int, seconds: float) -> None:
        """A step's measured time, in step order. The first step of a bucket at a new depth is the switch's, not
        the depth's (module docstring), and is dropped."""
        bucket = bucket_of(batch_size)
        switched = self._last_timed_depth.get(bucket) != depth
        self._last_timed_depth[bucket] = depth
        if switched:
            return
        if depth == 0:
            self._since_plain[bucket] = 0
        key = (bucket, depth)
        old = self.step_time.get(key)
        self.step_time[key] = seconds if old is None else (1 - EMA) * old + EMA * seconds

    def record_acceptance(self, seq_id: int, drafted: int, accepted: int) -> None:
        """A verify step of sequence seq_id: `accepted` of its `drafted` drafts were accepted (0 drafted: it sat
        this step out)."""
        s = self.seqs.setdefault(seq_id, _SeqAcceptance())
        if drafted == 0:
            s.steps_off += 1
            return
        was_off = s.rate < self.min_acceptance and s.tried > 0
        s.steps_off = 0
        tried = accepted + (1 if accepted < drafted else 0)
        s.accepted = (1 - EMA) * s.accepted + EMA * accepted
        s.tried = (1 - EMA) * s.tried + EMA * tried
        if was_off:   # that was a probe: wait twice as long before the next one if it failed, reset if it paid
            failed = s.rate < self.min_acceptance
            s.probe_after = min(2 * (s.probe_after or self.probe_every), MAX_PROBE_GAP) if failed else 0

    def forget(self, seq_id: int) -> None:
        self.seqs.pop(seq_id, None)
