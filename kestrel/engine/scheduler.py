"""Continuous batching: which sequences run this step, with how many query tokens each.

One step has a token budget (max_num_batched_tokens). Running sequences go first (a decode costs one token, an
unfinished prefill its next chunk); waiting sequences are admitted FIFO with what budget and blocks remain, so
prefill chunks and decodes share a step. When a running sequence needs a block and none is free, the most
recently admitted running sequence is preempted: its blocks are freed and it is recomputed later from its
tokens (prompt + output so far), which yields the same tokens.

A waiting sequence holds no blocks. A prefix match lends an admitted sequence the cached blocks of its head; when
the blocks for the rest of its first chunk cannot be found, the match is given back at once. Were the waiting
sequence to keep it, the blocks would be pinned by a sequence that is not running: with a small cache a preempted
sequence re-matching its own prompt could hold what the running ones need, and they would preempt each other
forever while it waits (a livelock, found with 8 sequences on 40 blocks of 4 tokens).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from kestrel.cache.block_pool import BlockPool, OutOfBlocks
from kestrel.cache.radix import PrefixCache
from kestrel.engine.request import Sequence, SeqStatus


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    start: int               # first position computed this step (= num_computed_tokens before the step)
    num_tokens: int          # query tokens this step
    completes_prompt: bool   # after this step every token is in the cache, so the next one can be sampled


@dataclass(slots=True)
class StepPlan:
    scheduled: list[ScheduledSeq]
    preempted: list[Sequence]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, pool: BlockPool, prefix_cache: PrefixCache, max_num_seqs: int,
                 max_num_batched_tokens: int) -> None:
        self.pool = pool
        self.prefix_cache = prefix_cache
        self.block_size = pool.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted: list[Sequence] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.grow(seq, seq.num_computed_tokens + num_new):
                # Free blocks by preempting from the back; the sequence itself may be the victim.
                while not self.grow(seq, seq.num_computed_tokens + num_new):
                    victim = self.running[-1]
                    self._preempt(victim)
                    preempted.append(victim)
                    if victim is seq:
                        break
                if seq.status is not SeqStatus.RUNNING:
                    break
            remaining = seq.num_tokens - seq.num_computed_tokens
            scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, num_new, num_new == remaining))
            budget -= num_new
            i += 1
        skipped: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            seq = self.waiting[0]
            if self._waits_for_sibling(seq):
                skipped.append(self.waiting.popleft())
                continue
            matched = seq.num_computed_tokens == 0 and not seq.block_ids
            if matched:
                self._match_prefix(seq)
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.grow(seq, seq.num_computed_tokens + num_new):
                if matched:   # a waiting sequence holds no blocks (module docstring): the match is undone
                    self._drop_blocks(seq)
                break
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            self.running.append(seq)
            remaining = seq.num_tokens - seq.num_computed_tokens
            scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, num_new, num_new == remaining))
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))
        return StepPlan(scheduled, preempted)

    def _waits_for_sibling(self, seq: Sequence) -> bool:
        """Samples 1..n-1 of a request wait until sample 0 has prefilled the prompt, then share its blocks
        through the prefix cache instead of computing the same prompt n times."""
        first = seq.prefill_leader
        return (first is not None and not self.prefix_cache.is_disabled and not first.is_finished
                and first.num_computed_tokens < first.num_prompt_tokens)

    def _match_prefix(self, seq: Sequence) -> None:
        match = self.prefix_cache.match(seq.token_ids())
        if match.blocks:
            seq.block_ids = list(match.blocks)
            seq.num_computed_tokens = match.num_tokens
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = match.num_tokens

    def _drop_blocks(self, seq: Sequence) -> None:
        """The sequence gives its blocks back and will compute its tokens again: a preemption, or a prefix match
        whose sequence could not be admitted after all (cached blocks stay in the tree, so the next try matches
        them again)."""
        self.pool.release(seq.block_ids)
        seq.block_ids = []
        seq.num_computed_tokens = 0

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Make sure the sequence owns blocks for num_tokens tokens; evict cached prefixes before failing (never
        preempts: speculative drafts ask for blocks this way and simply draft less when there are none)."""
        needed = -(-num_tokens // self.block_size) - len(seq.block_ids)
        if needed <= 0:
            return True
        if needed > self.pool.num_free:
            self.prefix_cache.evict(needed - self.pool.num_free)
        try:
            seq.block_ids.extend(self.pool.allocate(needed))
        except OutOfBlocks:
            return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._drop_blocks(seq)
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def rollback(self, seq: Sequence, num_tokens: int) -> None:
        """KV rollback: drop the last `num_tokens` output tokens (speculative tokens that lost). Their cache slots
        become free to overwrite, and blocks that no longer hold any kept token go back to the pool."""
        assert 0 <= num_tokens <= seq.num_output_tokens, "rollback past the prompt"
        if num_tokens:
            del seq.output_token_ids[-num_tokens:]
        # The last kept token is fed again next step (its KV is rewritten in place) so its logits exist.
        seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens - 1)
        keep = -(-seq.num_tokens // self.block_size)
        if len(seq.block_ids) > keep:
            self.pool.release(seq.block_ids[keep:])
            del seq.block_ids[keep:]

    def cache_prompt(self, seq: Sequence) -> None:
        """Publish a freshly prefilled prompt's full blocks, so siblings and later requests reuse them at once."""
        self.prefix_cache.insert(seq.prompt_token_ids[: seq.num_computed_tokens], seq.block_ids)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Remove a sequence wherever it is and return its blocks (its full blocks go to the prefix cache)."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        else:
            return
        if seq.block_ids:
            # Only tokens whose K/V are computed may be cached.
            computed = seq.token_ids()[: seq.num_computed_tokens]
            self.prefix_cache.insert(computed, seq.block_ids)
            self.pool.release(seq.block_ids)
            seq.block_ids = []
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        seq.finished_time = time.monotonic()
