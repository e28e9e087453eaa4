"""The draft tree: which drafted tokens a tree verify step checks, as a fixed shape per configuration.

The drafter runs its K chain steps as for a chain, each following its own top-1 token, and keeps the top-k
tokens of every step. The tree hangs the k candidates of step d under the chain's node of depth d - 1, so a
rejected chain token still leaves its k - 1 runners-up to be tried at that depth:

    K = 3, topk = 3:             root (the last verified token)
                                /   |   \\
                          (1,0)  (1,1)  (1,2)          depth 1: step 1's top-3; (1,0) is the chain's token
                         /  |  \\
                    (2,0) (2,1) (2,2)                  depth 2: step 2's top-3, under the chain's (1,0)
                   /  |  \\
              (3,0) (3,1) (3,2)                        depth 3

A budget of N < K * topk draft tokens (at least K) keeps the chain, then the runners-up by (depth + rank,
depth): those nearest the root first. The shape never changes with the tokens, so verify and drafter steps are captured
in CUDA graphs once per batch size, and one mask serves every sequence. Unlike SGLang's EAGLE tree, only the
chain is expanded (a branch off a runner-up would need drafter steps of its own): the trade is fewer drafter
steps for fewer deep alternatives.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class DraftTree:
    depth: int                               # K: chain steps
    topk: int                                # candidates kept per step
    nodes: tuple[tuple[int, int], ...]       # (depth 1..K, rank 0..topk-1) per node, in BFS order (root excluded)
    parents: tuple[int, ...]                 # each node's parent node index, -1: the root

    @property
    def size(self) -> int:
        """Draft nodes, the root excluded (a verify step has size + 1 query tokens a sequence)."""
        return len(self.nodes)

    @property
    def depths(self) -> list[int]:
        """Each query token's depth, the root (0) first: its rotary position is the step's start + depth."""
        return [0] + [d for d, _ in self.nodes]

    def mask(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """[size + 1, size + 1] bool: query i sees key j iff j is i or an ancestor of i (attention/base.py)."""
        n = self.size + 1
        mask = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            j = i
            while j >= 0:
                mask[i, j] = True
                j = self.parents[j - 1] + 1 if j > 0 else -1
        return mask.to(device)

    def node_tokens(self, steps: list[list[int]]) -> list[int]:
        """Each node's token from the drafter's per-step candidates: steps[d - 1][r] is step d's rank-r token."""
        return [steps[d - 1][r] for d, r in self.nodes]

    def chain_node(self, depth: int) -> int:
        """The index of the chain's node at `depth` (1..K): rank 0."""
        return self.nodes.index((depth, 0))


def draft_tree(depth: int, topk: int, budget: int | None = None) -> DraftTree:
    """The tree of K = depth chain steps with `topk` candidates each, pruned to `budget` nodes (default all)."""
    every = [(d, r) for d in range(1, depth + 1) for r in range(topk)]
    budget = len(every) if budget is None else budget
    if not depth <= budget <= len(every):
        raise ValueError(f"a tree of depth {depth} and topk {topk} holds {depth}..{len(every)} draft nodes, "
                         f"not {budget}")
    # the chain first, then the runners-up nearest the root; then BFS order (by depth, then rank)
    kept = sorted(sorted(every, key=lambda n: (n[1] > 0, n[0] + n[1], n[0]))[:budget])
    index = {node: i for i, node in enumerate(kept)}
    parents = tuple(-1 if d == 1 else index[(d - 1, 0)] for d, _ in kept)
    return DraftTree(depth, topk, tuple(kept), parents)
