"""Prefix cache: reuse the KV blocks of token prefixes that earlier requests already computed.

Chat and agent traffic repeats long prefixes (system prompt, tool schemas, the conversation so far). The radix
tree maps token prefixes, in whole blocks, to the physical KV blocks that hold them (the model is SGLang's radix
cache). Only FULL blocks are cached: a block is a unit of KV memory, and a partly filled one is still being
written by its sequence.

Tree (block_size = 4). Each edge holds whole block-sized chunks of tokens and one block id per chunk; children
are keyed by the first chunk of their edge, so an edge splits only at block boundaries:

    insert A = [1 2 3 4 | 5 6 7 8 | 9 9 9 9]              blocks a0 a1 a2
    insert B = [1 2 3 4 | 5 6 7 8 | 7 7 7 7 | 8 8 8 8]    blocks b0 b1 b2 b3   (b0, b1: duplicates, not kept)
    insert C = [1 2 3 4 | 6 6 6 6]                        blocks c0 c1         (c0: duplicate, not kept)

    root
     └─ [1 2 3 4] -> [a0]                       split when C diverged after one chunk
         ├─ [5 6 7 8] -> [a1]                   split when B diverged after two chunks
         │   ├─ [9 9 9 9] -> [a2]
         │   └─ [7 7 7 7 | 8 8 8 8] -> [b2 b3]  one edge, two blocks
         └─ [6 6 6 6] -> [c1]

Memory ownership is nothing but BlockPool reference counts:

    pool.ref_counts[b] = (1 if b is in the tree) + (number of sequences whose block list holds b)

- match() retains the matched blocks once for the caller; the caller puts them at the head of its block list
  and releases them with the rest of its blocks (finish, abort, preemption). Matched blocks therefore have a
  count >= 2 and cannot be evicted while the sequence runs.
- insert() retains each block it adds to the tree; the caller still releases its own reference as usual.
- evict() releases tree blocks whose count is 1 (nobody else holds them), trimming leaves from the tail, least
  recently used first. A block evicted that way goes straight back to the free list.

Invariants: a tree block's tokens are final and never rewritten (only full blocks go in, and only blocks whose
tokens will not change); the same block id appears at most once in the tree; a node's last_access is never
older than any of its children's (a use touches the whole path from the root), so LRU leaf order is consistent.

What the CALLER must guarantee: never insert blocks holding tokens that can still be rolled back, e.g. draft
tokens of speculative decoding before verification; insert only accepted tokens. The tree cannot tell.

Cost: match and insert walk one path (O(prompt length)); evict and num_evictable_blocks visit the whole tree
(reference counts change outside the tree, so nothing is maintained incrementally), so call them when an
allocation fails or for metrics, not per token.
"""
from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from kestrel.cache.block_pool import BlockPool


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    blocks: list[int]   # physical blocks of the matched prefix, already retained once for the caller
    num_tokens: int     # len(blocks) * block_size


@dataclass(slots=True)
class PrefixCacheStats:
    """Cumulative counters (reset() keeps them, so they can feed Prometheus counters)."""
    queries: int = 0
    query_tokens: int = 0   # prompt tokens looked up
    hit_tokens: int = 0     # of those, tokens served from the cache

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


class PrefixCache(ABC):
    """What the scheduler calls; see the module docstring for who owns which block reference."""

    is_disabled = False

    def __init__(self) -> None:
        self.stats = PrefixCacheStats()

    @abstractmethod
    def match(self, token_ids: Sequence[int]) -> PrefixMatch:
        """Longest cached prefix of token_ids made of full blocks, never all of token_ids (the last token must
        be computed to get its logits). The blocks are retained for the caller, who releases them via the pool."""

    @abstractmethod
    def insert(self, token_ids: Sequence[int], blocks: Sequence[int]) -> int:
        """Cache the full blocks of a sequence (blocks[i] holds token_ids[i*bs:(i+1)*bs]); the tree takes its own
        reference on each block it adds. Where it already holds a block for a chunk it keeps that one and the
        caller's duplicate is left alone. Returns the number of tokens newly cached."""

    @abstractmethod
    def evict(self, num_blocks: int) -> int:
        """Free up to num_blocks blocks held only by the tree, least recently used leaves first; returns how
        many went back to the free list."""

    @abstractmethod
    def num_cached_blocks(self) -> int: ...

    @abstractmethod
    def num_evictable_blocks(self) -> int:
        """Blocks evict() could free now (held only by the tree)."""

    @abstractmethod
    def reset(self) -> None:
        """Release every block the tree holds (e.g. after new weights are loaded)."""

    def _record(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.stats.queries += 1
        self.stats.query_tokens += num_query_tokens
        self.stats.hit_tokens += num_hit_tokens


class NoPrefixCache(PrefixCache):
    """--disable-prefix-cache: the same interface, caching nothing (still counts queries for the metrics)."""

    is_disabled = True

    def match(self, token_ids: Sequence[int]) -> PrefixMatch:
        self._record(len(token_ids), 0)
        return PrefixMatch(blocks=[], num_tokens=0)

    def insert(self, token_ids: Sequence[int], blocks: Sequence[int]) -> int:
        return 0

    def evict(self, num_blocks: int) -> int:
        return 0

    def num_cached_blocks(self) -> int:
        return 0

    def num_evictable_blocks(self) -> int:
        return 0

    def reset(self) -> None:
        pass


class _Node:
    __slots__ = ("key", "blocks", "children", "parent", "last_access", "serial")

    def __init__(self, key: list[int], blocks: list[int], parent: _Node | None, last_access: int,
                 serial: int) -> None:
        self.key = key                              # tokens of the edge into this node, len = len(blocks) * bs
        self.blocks = blocks
        self.children: dict[tuple[int, ...], _Node] = {}   # first chunk of the child's key -> child
        self.parent = parent
        self.last_access = last_access              # logical clock, not wall time: deterministic LRU
        self.serial = serial                        # creation order: breaks LRU ties deterministically


class RadixPrefixCache(PrefixCache):
    def __init__(self, pool: BlockPool) -> None:
        super().__init__()
        self.pool = pool
        self.block_size = pool.block_size
        self._clock = 0
        self._serial = 0
        self._num_cached_blocks = 0
        self._root = self._new_node([], [], None)

    # ---- the interface -------------------------------------------------------------------------------------

    def match(self, token_ids: Sequence[int]) -> PrefixMatch:
        tokens = list(token_ids)
        max_chunks = max(len(tokens) - 1, 0) // self.block_size
        blocks = self._descend(tokens, max_chunks)[1]
        self.pool.retain(blocks)
        num_tokens = len(blocks) * self.block_size
        self._record(len(tokens), num_tokens)
        return PrefixMatch(blocks=blocks, num_tokens=num_tokens)

    def insert(self, token_ids: Sequence[int], blocks: Sequence[int]) -> int:
        tokens = list(token_ids)
        bs = self.block_size
        num_chunks = len(tokens) // bs
        assert len(blocks) >= num_chunks, f"{len(tokens)} tokens need {num_chunks} blocks, got {len(blocks)}"
        node, path_blocks = self._descend(tokens, num_chunks)
        done = len(path_blocks)
        if done == num_chunks:
            return 0
        new_blocks = list(blocks[done:num_chunks])
        new_key = tokens[done * bs:num_chunks * bs]
        self.pool.retain(new_blocks)
        if node is not self._root and not node.children:
            # Growing a leaf in place keeps a sequence that inserts as it goes (chunked prefill, long decodes)
            # from building a chain of single-child nodes.
            node.key.extend(new_key)
            node.blocks.extend(new_blocks)
        else:
            node.children[tuple(new_key[:bs])] = self._new_node(new_key, new_blocks, node)
        self._num_cached_blocks += len(new_blocks)
        return len(new_blocks) * bs

    def evict(self, num_blocks: int) -> int:
        bs = self.block_size
        ref_counts = self.pool.ref_counts
        heap = [(leaf.last_access, leaf.serial, leaf) for leaf in self._leaves()]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_blocks:
            _, _, leaf = heapq.heappop(heap)
            # Trim from the tail: a running sequence that matched this edge holds a head of it, never a gap.
            n = 0
            while n < len(leaf.blocks) and freed + n < num_blocks and ref_counts[leaf.blocks[-1 - n]] == 1:
                n += 1
            if n == 0:
                continue    # its last block is in use: this leaf, and so its ancestors, stay
            edge = tuple(leaf.key[:bs])
            dropped = leaf.blocks[-n:]
            del leaf.blocks[-n:]
            del leaf.key[-n * bs:]
            self.pool.release(dropped)
            freed += n
            self._num_cached_blocks -= n
            if not leaf.blocks:
                parent = leaf.parent
                assert parent is not None
                del parent.children[edge]
                if parent is not self._root and not parent.children:
                    heapq.heappush(heap, (parent.last_access, parent.serial, parent))
        return freed

    def num_cached_blocks(self) -> int:
        return self._num_cached_blocks

    def num_evictable_blocks(self) -> int:
        # Same recurrence as evict() with no limit: a node's tail blocks held only by the tree are evictable
        # once all its children are gone, i.e. fully evictable themselves.
        ref_counts = self.pool.ref_counts
        fully_evictable: dict[_Node, bool] = {}
        total = 0
        for node in reversed(self._preorder()):   # children before their parent
            if node is self._root:
                continue
            if not all(fully_evictable[c] for c in node.children.values()):
                fully_evictable[node] = False
                continue
            n = 0
            while n < len(node.blocks) and ref_counts[node.blocks[-1 - n]] == 1:
                n += 1
            total += n
            fully_evictable[node] = n == len(node.blocks)
        return total

    def reset(self) -> None:
        blocks = [b for node in self._preorder() for b in node.blocks]
        self.pool.release(blocks)
        self._num_cached_blocks = 0
        self._root = self._new_node([], [], None)

    # ---- debugging -----------------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        bs = self.block_size
        seen: set[int] = set()
        for node in self._preorder():
            if node is not self._root:
                assert node.blocks and len(node.key) == len(node.blocks) * bs, "edge length != blocks"
                assert node.parent is not None and node.parent.children.get(tuple(node.key[:bs])) is node
                assert node.parent.last_access >= node.last_access, "parent older than child"
            for key, child in node.children.items():
                assert child.parent is node and len(key) == bs
            for b in node.blocks:
                assert b not in seen, f"block {b} is in the tree twice"
                assert self.pool.ref_counts[b] >= 1, f"tree block {b} has ref count {self.pool.ref_counts[b]}"
                seen.add(b)
        assert len(seen) == self._num_cached_blocks

    # ---- internals -----------------------------------------------------------------------------------------

    def _new_node(self, key: list[int], blocks: list[int], parent: _Node | None) -> _Node:
        self._serial += 1
        return _Node(key, blocks, parent, self._clock, self._serial)

    def _descend(self, tokens: list[int], max_chunks: int) -> tuple[_Node, list[int]]:
        """Follow tokens[:max_chunks * bs] down from the root, touching every node on the way. Returns the
        blocks matched and the node where the match ends; an edge matched only in part is split first, so that
        its unmatched tail keeps its old timestamp and is evicted before the part in use."""
        bs = self.block_size
        self._clock += 1
        node = self._root
        node.last_access = self._clock
        blocks: list[int] = []
        while len(blocks) < max_chunks:
            start = len(blocks) * bs
            child = node.children.get(tuple(tokens[start:start + bs]))
            if child is None:
                break
            n = self._common_chunks(child.key, tokens, start, max_chunks - len(blocks))
            if n < len(child.blocks):
                child = self._split(child, n)
            child.last_access = self._clock
            blocks.extend(child.blocks)
            node = child
        return node, blocks

    def _common_chunks(self, key: list[int], tokens: list[int], start: int, max_chunks: int) -> int:
        """Whole chunks that key and tokens[start:] share, at most max_chunks (the first is known to match)."""
        bs = self.block_size
        limit = min(len(key) // bs, max_chunks)
        if key[:limit * bs] == tokens[start:start + limit * bs]:
            return limit
        n = 1
        while n < limit and key[n * bs:(n + 1) * bs] == tokens[start + n * bs:start + (n + 1) * bs]:
            n += 1
        return n

    def _split(self, child: _Node, n: int) -> _Node:
        """Cut child's edge after n chunks; returns the new middle node that takes the first n."""
        #   parent ─[k0 k1 k2]─► child      becomes      parent ─[k0]─► mid ─[k1 k2]─► child   (n = 1)
        bs = self.block_size
        parent = child.parent
        assert parent is not None and 0 < n < len(child.blocks)
        mid = self._new_node(child.key[:n * bs], child.blocks[:n], parent)
        child.key = child.key[n * bs:]
        child.blocks = child.blocks[n:]
        child.parent = mid
        mid.children[tuple(child.key[:bs])] = child
        parent.children[tuple(mid.key[:bs])] = mid
        return mid

    def _preorder(self) -> list[_Node]:
        nodes, stack = [], [self._root]
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.children.values())
        return nodes

    def _leaves(self) -> list[_Node]:
        return [n for n in self._preorder() if not n.children and n is not self._root]
