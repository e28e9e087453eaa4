"""The radix prefix cache: what it matches, what it holds, what it evicts, and that it never corrupts the pool."""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kestrel.cache.block_pool import BlockPool
from kestrel.cache.radix import NoPrefixCache, PrefixMatch, RadixPrefixCache


def make(num_blocks: int = 32, block_size: int = 2) -> tuple[BlockPool, RadixPrefixCache]:
    pool = BlockPool(num_blocks, block_size)
    return pool, RadixPrefixCache(pool)


def finish(pool: BlockPool, cache: RadixPrefixCache, tokens: list[int]) -> list[int]:
    """A request that computed `tokens` from scratch finishes: insert its blocks, then drop its own references."""
    blocks = pool.allocate(-(-len(tokens) // pool.block_size))
    cache.insert(tokens, blocks)
    pool.release(blocks)
    cache.check_invariants()
    return blocks


# ---- match and insert ------------------------------------------------------------------------------------------

def test_empty_cache_matches_nothing_but_counts_the_query():
    pool, cache = make()
    assert cache.match([1, 2, 3, 4, 5]) == PrefixMatch(blocks=[], num_tokens=0)
    assert (cache.stats.queries, cache.stats.query_tokens, cache.stats.hit_tokens) == (1, 5, 0)
    assert pool.num_free == pool.num_blocks


def test_match_returns_inserted_blocks_retained_once_for_the_caller():
    pool, cache = make()
    blocks = finish(pool, cache, [1, 2, 3, 4, 5, 6])
    assert [pool.ref_counts[b] for b in blocks] == [1, 1, 1]     # only the tree holds them now
    m = cache.match([1, 2, 3, 4, 5, 6, 7])
    assert m.blocks == blocks and m.num_tokens == 6
    assert [pool.ref_counts[b] for b in blocks] == [2, 2, 2]
    pool.release(m.blocks)
    assert [pool.ref_counts[b] for b in blocks] == [1, 1, 1]
    assert cache.stats.hit_tokens == 6 and cache.stats.query_tokens == 7


def test_match_always_leaves_the_last_token_to_compute():
    pool, cache = make()
    blocks = finish(pool, cache, [1, 2, 3, 4, 5, 6])
    assert cache.match([1, 2, 3, 4, 5, 6]).blocks == blocks[:2]   # exact hit: last block recomputed
    assert cache.match([1, 2, 3, 4, 5]).blocks == blocks[:2]
    assert cache.match([1, 2, 3, 4]).blocks == blocks[:1]
    assert cache.match([1]).blocks == []
    assert cache.match([]).blocks == []


def test_only_full_blocks_are_inserted():
    pool, cache = make()
    blocks = pool.allocate(3)
    assert cache.insert([1, 2, 3, 4, 5], blocks) == 4            # the block holding only token 5 stays out
    assert [pool.ref_counts[b] for b in blocks] == [2, 2, 1]
    assert cache.num_cached_blocks() == 2
    pool.release(blocks)
    assert cache.match([1, 2, 3, 4, 5, 6, 7]).num_tokens == 4


def test_tree_keeps_its_own_block_when_another_sequence_computed_the_same_prefix():
    pool, cache = make()
    a = finish(pool, cache, [1, 2, 3, 4])
    b = pool.allocate(3)
    assert cache.insert([1, 2, 3, 4, 5, 6], b) == 2               # only the third chunk is new
    assert pool.ref_counts[b[0]] == 1 and pool.ref_counts[b[1]] == 1 and pool.ref_counts[b[2]] == 2
    pool.release(b)
    assert pool.ref_counts[b[0]] == 0                              # the caller's duplicate is simply freed
    assert cache.match([1, 2, 3, 4, 5, 6, 0]).blocks == a + [b[2]]
    assert cache.insert([1, 2, 3, 4, 5, 6], a + [b[2]]) == 0      # re-inserting the same blocks is a no-op
    assert pool.ref_counts[b[2]] == 2                              # tree + the match above


def test_divergence_splits_an_edge_at_a_block_boundary():
    # The tree drawn in the module docstring (block_size 4).
    pool, cache = make(block_size=4)
    a = finish(pool, cache, [1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 9])
    b = finish(pool, cache, [1, 2, 3, 4, 5, 6, 7, 8, 7, 7, 7, 7, 8, 8, 8, 8])
    c = finish(pool, cache, [1, 2, 3, 4, 6, 6, 6, 6])
    assert cache.num_cached_blocks() == 6
    assert [pool.ref_counts[x] for x in (*a, *b[2:], c[1])] == [1] * 6
    assert pool.ref_counts[b[0]] == pool.ref_counts[b[1]] == pool.ref_counts[c[0]] == 0
    assert cache.match([1, 2, 3, 4, 5, 6, 7, 8, 7, 7, 7, 7, 8, 8, 8, 8, 0]).blocks == [a[0], a[1], b[2], b[3]]
    assert cache.match([1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 9, 0]).blocks == a
    assert cache.match([1, 2, 3, 4, 6, 6, 6, 6, 0]).blocks == [a[0], c[1]]
    assert cache.match([1, 2, 3, 4, 5, 6, 7, 0, 0]).blocks == [a[0]]   # a partial chunk never matches
    assert cache.match([2, 2, 3, 4, 5]).blocks == []
    cache.check_invariants()


def test_match_can_end_inside_an_edge():
    pool, cache = make()
    blocks = finish(pool, cache, [1, 1, 2, 2, 3, 3, 4, 4])
    m = cache.match([1, 1, 2, 2, 9, 9])
    assert m.blocks == blocks[:2]
    cache.check_invariants()
    pool.release(m.blocks)
    assert cache.match([1, 1, 2, 2, 3, 3, 4, 4, 5]).blocks == blocks


# ---- eviction --------------------------------------------------------------------------------------------------

def test_evict_frees_least_recently_used_leaves_first():
    pool, cache = make()
    a = finish(pool, cache, [1, 1, 2, 2])
    b = finish(pool, cache, [1, 1, 3, 3])
    c = finish(pool, cache, [4, 4])
    pool.release(cache.match([1, 1, 2, 2, 0]).blocks)              # A is now the most recently used
    order = []
    while cache.num_cached_blocks():
        before = set(i for i, rc in enumerate(pool.ref_counts) if rc)
        assert cache.evict(1) == 1
        cache.check_invariants()
        order += sorted(before - set(i for i, rc in enumerate(pool.ref_counts) if rc))
    assert order == [b[1], c[0], a[1], a[0]]                       # shared [1 1] goes once both branches are gone
    assert pool.num_free == pool.num_blocks


def test_evict_never_frees_blocks_held_by_a_running_sequence():
    pool, cache = make()
    blocks = finish(pool, cache, [1, 1, 2, 2, 3, 3, 4, 4])
    finish(pool, cache, [5, 5, 6, 6])
    running = cache.match([1, 1, 2, 2, 0])                         # holds the first two blocks of the first edge
    assert cache.num_evictable_blocks() == 4
    assert cache.evict(100) == 4
    assert cache.num_cached_blocks() == 2 and cache.num_evictable_blocks() == 0
    assert cache.evict(100) == 0
    assert [pool.ref_counts[b] for b in blocks[:2]] == [2, 2]
    pool.release(running.blocks)
    assert cache.evict(100) == 2 and pool.num_free == pool.num_blocks


def test_a_block_in_use_at_the_tail_pins_the_whole_path():
    pool, cache = make()
    finish(pool, cache, [1, 1, 2, 2])
    own = pool.allocate(3)                                         # computed the same prompt without a hit
    cache.insert([1, 1, 2, 2, 3, 3], own)                          # tree: [1 1][2 2] from before + own[2]
    assert cache.num_evictable_blocks() == 0                       # own[2] is still held by the sequence
    assert cache.evict(10) == 0
    pool.release(own)
    assert cache.num_evictable_blocks() == 3 and cache.evict(10) == 3


def test_evict_stops_at_the_requested_count():
    pool, cache = make()
    finish(pool, cache, [1, 1, 2, 2, 3, 3, 4, 4])
    assert cache.evict(0) == 0
    assert cache.evict(3) == 3
    assert cache.match([1, 1, 2, 2, 3, 3, 4, 4, 5]).num_tokens == 2


def test_reset_releases_everything_the_tree_holds_and_keeps_the_stats():
    pool, cache = make()
    finish(pool, cache, [1, 1, 2, 2])
    held = cache.match([1, 1, 2, 2, 3, 3, 0])
    finish(pool, cache, [1, 1, 7, 7, 8, 8])
    cache.reset()
    assert cache.num_cached_blocks() == 0 and cache.match([1, 1, 2, 2, 0]).blocks == []
    assert cache.stats.queries == 2
    assert pool.num_free == pool.num_blocks - len(held.blocks)     # the running sequence's blocks survive
    pool.release(held.blocks)
    assert pool.num_free == pool.num_blocks
    pool.check_invariants()


def test_no_prefix_cache_caches_nothing():
    pool = BlockPool(8, 2)
    cache = NoPrefixCache()
    blocks = pool.allocate(2)
    assert cache.insert([1, 1, 2, 2], blocks) == 0
    assert cache.match([1, 1, 2, 2, 3]) == PrefixMatch(blocks=[], num_tokens=0)
    assert (cache.num_cached_blocks(), cache.num_evictable_blocks(), cache.evict(5)) == (0, 0, 0)
    assert cache.stats.queries == 1 and cache.stats.query_tokens == 5 and cache.stats.hit_rate == 0.0
    assert [pool.ref_counts[b] for b in blocks] == [1, 1]
    cache.reset()


# ---- properties against a plain dict of prefixes ------------------------------------------------------------------

token_lists = st.lists(st.integers(0, 2), max_size=12)
ops = st.lists(st.one_of(
    st.tuples(st.just("insert"), token_lists),
    st.tuples(st.just("match"), token_lists),
    st.tuples(st.just("hold"), token_lists),        # match and keep the blocks, like a running sequence
    st.tuples(st.just("drop"), st.integers(0, 7)),  # a running sequence finishes
    st.tuples(st.just("evict"), st.integers(0, 6)),
), max_size=30)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_tree_agrees_with_a_dict_of_prefixes_and_eviction_only_forgets(script):
    pool, cache = make(num_blocks=128, block_size=2)
    bs = pool.block_size
    model: dict[tuple[int, ...], int] = {}     # prefix (whole chunks) -> the block the tree should return
    held: list[list[int]] = []
    for op, arg in script:
        if op == "insert":
            blocks = pool.allocate(len(arg) // bs)
            cache.insert(arg, blocks)
            for i in range(len(blocks)):
                model.setdefault(tuple(arg[:(i + 1) * bs]), blocks[i])
            pool.release(blocks)
        elif op in ("match", "hold"):
            m = cache.match(arg)
            expected = []
            for i in range(max(len(arg) - 1, 0) // bs):
                if (key := tuple(arg[:(i + 1) * bs])) not in model:
                    break
                expected.append(model[key])
            assert m.blocks == expected and m.num_tokens == len(expected) * bs
            if op == "hold":
                held.append(m.blocks)
            else:
                pool.release(m.blocks)
        elif op == "drop" and held:
            pool.release(held.pop(arg % len(held)))
        elif op == "evict":
            evictable = cache.num_evictable_blocks()
            assert cache.evict(arg) == min(arg, evictable)
            alive = {b for b, rc in enumerate(pool.ref_counts) if rc}
            model = {k: b for k, b in model.items() if b in alive}
            assert all(b in alive for blocks in held for b in blocks)
        cache.check_invariants()
        pool.check_invariants()
        assert cache.num_cached_blocks() == len(model)
        assert sum(pool.ref_counts) == len(model) + sum(len(b) for b in held)
    for blocks in held:
        pool.release(blocks)
    assert cache.num_evictable_blocks() == cache.num_cached_blocks()
    cache.reset()
    assert pool.num_free == pool.num_blocks


# ---- a scheduler's worth of traffic ----------------------------------------------------------------------------

@dataclass
class SimRequest:
    tokens: list[int]           # prompt + generated so far
    max_len: int                # finishes when it has this many tokens
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0       # tokens whose K/V is written; always len(tokens) - 1 while running


class Simulation:
    """Continuous batching in miniature: match on admission, allocate (evicting, then preempting, when short),
    fork siblings (n > 1), insert while running and at the end, abort at random. Each block's "K/V" is the list of
    tokens written into it, so a match that returned a stale or foreign block would be caught."""

    def __init__(self, seed: int, num_requests: int, num_blocks: int = 48, block_size: int = 4) -> None:
        self.rng = random.Random(seed)
        self.pool = BlockPool(num_blocks, block_size)
        self.cache = RadixPrefixCache(self.pool)
        self.bs = block_size
        self.kv: dict[int, list[int]] = {}
        self.waiting: list[SimRequest] = []
        self.running: list[SimRequest] = []
        self.num_requests = num_requests
        self.arrived = self.created = self.done = 0    # created = arrived + forked siblings
        self.preemptions = self.evictions = self.forks = self.aborts = 0
        self.prefixes = [[self.rng.randrange(6) for _ in range(self.rng.randrange(0, 40))] for _ in range(6)]

    def new_request(self) -> SimRequest:
        prompt = self.rng.choice(self.prefixes) + [self.rng.randrange(6) for _ in range(self.rng.randint(1, 20))]
        return SimRequest(tokens=prompt, max_len=len(prompt) + self.rng.randint(1, 20))

    def allocate(self, n: int) -> list[int] | None:
        if n > self.pool.num_free:
            want = n - self.pool.num_free
            evictable = self.cache.num_evictable_blocks()
            freed = self.cache.evict(want)
            assert freed == min(want, evictable)
            self.evictions += freed
        if n > self.pool.num_free:
            return None
        blocks = self.pool.allocate(n)
        for b in blocks:
            self.kv[b] = []
        return blocks

    def write(self, r: SimRequest, upto: int) -> None:
        for pos in range(r.num_computed, upto):
            b = r.blocks[pos // self.bs]
            assert len(self.kv[b]) == pos % self.bs, f"write into block {b} that is not this sequence's to fill"
            self.kv[b].append(r.tokens[pos])
        r.num_computed = upto

    def free(self, r: SimRequest) -> None:
        self.pool.release(r.blocks)
        r.blocks, r.num_computed = [], 0

    def admit(self) -> None:
        while self.waiting and len(self.running) < 8:
            r = self.waiting[0]
            m = self.cache.match(r.tokens)
            for i, b in enumerate(m.blocks):
                assert self.kv[b] == r.tokens[i * self.bs:(i + 1) * self.bs], "prefix hit returned foreign K/V"
            new = self.allocate(-(-len(r.tokens) // self.bs) - len(m.blocks))
            if new is None:
                self.pool.release(m.blocks)
                return
            self.waiting.pop(0)
            r.blocks, r.num_computed = m.blocks + new, m.num_tokens
            self.write(r, len(r.tokens))                     # prefill the rest of the prompt
            r.tokens.append(self.rng.randrange(6))           # and sample the first token
            self.running.append(r)
            if self.rng.random() < 0.05:
                self.fork(r)

    def fork(self, parent: SimRequest) -> None:
        """n > 1: the sibling shares the parent's full blocks and copies the partly filled last one."""
        full = parent.num_computed // self.bs
        tail = self.allocate(1) if parent.num_computed % self.bs else []
        if tail is None:
            return
        self.pool.retain(parent.blocks[:full])
        child = SimRequest(tokens=parent.tokens[:-1] + [self.rng.randrange(6)],
                           max_len=parent.max_len + self.rng.randint(-3, 3),
                           blocks=parent.blocks[:full] + tail, num_computed=parent.num_computed)
        if tail:
            self.kv[tail[0]] = list(self.kv[parent.blocks[full]])
        self.running.append(child)
        self.created += 1
        self.forks += 1

    def preempt_newest(self) -> SimRequest:
        victim = self.running.pop()
        self.free(victim)
        self.waiting.insert(0, victim)                      # resumes first, re-matching what it computed
        self.preemptions += 1
        return victim

    def decode(self) -> None:
        for r in list(self.running):
            if r not in self.running:                       # preempted earlier in this step
                continue
            if self.rng.random() < 0.01:                    # client went away
                if self.rng.random() < 0.5:
                    self.cache.insert(r.tokens[:r.num_computed], r.blocks)
                self.running.remove(r)
                self.free(r)
                self.done += 1
                self.aborts += 1
                continue
            if self.rng.random() < 0.05:                    # cache what is computed so far (chunked prefill)
                self.cache.insert(r.tokens[:r.num_computed], r.blocks)
            if r.num_computed == len(r.blocks) * self.bs:
                new = self.allocate(1)
                while new is None:
                    if self.preempt_newest() is r:
                        break
                    new = self.allocate(1)
                if new is None:
                    continue
                r.blocks += new
            self.write(r, len(r.tokens))
            r.tokens.append(self.rng.randrange(6))
            if len(r.tokens) >= r.max_len:
                self.cache.insert(r.tokens[:r.num_computed], r.blocks)
                self.running.remove(r)
                self.free(r)
                self.done += 1

    def check(self) -> None:
        self.pool.check_invariants()
        self.cache.check_invariants()
        holders = sum(len(r.blocks) for r in self.running)
        assert sum(self.pool.ref_counts) == holders + self.cache.num_cached_blocks()
        assert self.cache.num_evictable_blocks() <= self.cache.num_cached_blocks()

    def run(self) -> None:
        for _ in range(100_000):
            if self.arrived == self.num_requests and not self.waiting and not self.running:
                return
            for _ in range(self.rng.randint(0, 2)):
                if self.arrived < self.num_requests:
                    self.waiting.append(self.new_request())
                    self.arrived += 1
                    self.created += 1
            self.admit()
            self.decode()
            self.check()
        raise AssertionError("simulation did not drain")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_thousand_requests_share_prefixes_without_leaking_or_double_freeing(seed):
    sim = Simulation(seed, num_requests=1000)
    sim.run()
    assert sim.done == sim.created
    assert sim.pool.num_free + sim.cache.num_cached_blocks() == sim.pool.num_blocks
    assert sim.cache.num_evictable_blocks() == sim.cache.num_cached_blocks()
    stats = sim.cache.stats
    assert stats.hit_tokens > 0.1 * stats.query_tokens      # the shared prefixes were actually reused
    assert sim.preemptions and sim.evictions and sim.forks and sim.aborts
    sim.cache.reset()
    assert sim.pool.num_free == sim.pool.num_blocks
    sim.pool.check_invariants()
