"""Paged KV blocks: a free list plus a reference count per block.

A block holds `block_size` consecutive tokens of one sequence in every layer. Blocks are reference-counted so
that the radix prefix cache and forked sequences (n > 1) can share them: a block returns to the free list only
when its last holder lets go.
"""
from __future__ import annotations

from collections import deque


class OutOfBlocks(Exception):
    """Raised when an allocation asks for more blocks than are free; the scheduler preempts and retries."""


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def allocate(self, count: int) -> list[int]:
        """Take `count` free blocks, each with reference count 1."""
        if count > len(self._free):
            raise OutOfBlocks(f"asked for {count} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(count)]
        for b in blocks:
            assert self.ref_counts[b] == 0, f"block {b} on the free list had ref count {self.ref_counts[b]}"
            self.ref_counts[b] = 1
        return blocks

    def retain(self, blocks: list[int]) -> None:
        """Add one holder to blocks already in use (prefix sharing, forks)."""
        for b in blocks:
            assert self.ref_counts[b] > 0, f"retain of free block {b}"
            self.ref_counts[b] += 1

    def release(self, blocks: list[int]) -> None:
        """Drop one holder; blocks whose count reaches zero go back to the free list."""
        for b in blocks:
            assert self.ref_counts[b] > 0, f"double free of block {b}"
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self._free.append(b)

    def check_invariants(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        for b, rc in enumerate(self.ref_counts):
            assert (rc == 0) == (b in free), f"block {b}: ref count {rc}, on free list: {b in free}"
