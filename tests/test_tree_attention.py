"""Tree attention for speculative verify steps: ForwardBatch.tree_mask (drawn in kestrel/attention/base.py).

A tree step's query i of sequence s sees every key cached before the step and the step's key j iff
tree_mask[s, i, j] (a node sees itself and its ancestors); its rotary positions are start + depth, so attention
never reads batch.positions. The torch oracle is checked against a dense reference that lists each query's keys
explicitly; the Triton extend kernel (run by Triton's interpreter in a child pytest, as in test_triton_kernels.py)
is checked against the oracle.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.test_triton_kernels import TOLERANCE, random_paged_cache, start_locs
from tests.tolerances import scaled
from tests.triton_interpreter import INTERPRETED, run_file_under_interpreter
from tests.triton_interpreter import interpreted_only as interpreted_only_marker

interpreted_only = interpreted_only_marker("test_tree_kernels_under_triton_interpreter")


@pytest.mark.slow   # a child pytest running the file's kernels in Triton's interpreter
@pytest.mark.skipif(INTERPRETED, reason="this is the interpreter child")
def test_tree_kernels_under_triton_interpreter():
    run_file_under_interpreter(__file__, min_passed=19)   # all but the ones that skip in the child


# ------------------------------------------------------------------------------------------------ helpers

def random_parents(num_nodes: int, gen: torch.Generator) -> list[int]:
    """A random tree of num_nodes in BFS order: node 0 is the root (parent -1), each node's parent comes earlier
    and parents' children are numbered in the order the parents are."""
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, num_nodes)]
    order = [0]                                   # BFS renumbering
    for node in order:
        order += [c for c in range(num_nodes) if parents[c] == node]
    new_id = {old: new for new, old in enumerate(order)}
    return [-1 if parents[old] < 0 else new_id[parents[old]] for old in order]


def chain_parents(num_nodes: int) -> list[int]:
    return list(range(-1, num_nodes - 1))


def ancestors_and_self(parents: list[int], i: int) -> list[int]:
    nodes = []
    while i >= 0:
        nodes.append(i)
        i = parents[i]
    return nodes


def depths(parents: list[int]) -> list[int]:
    return [len(ancestors_and_self(parents, i)) - 1 for i in range(len(parents))]


def tree_mask_of(trees: list[list[int]]) -> torch.Tensor:
    """bool [S, Q, Q], Q the largest tree; padding rows and columns False."""
    q = max(len(t) for t in trees)
    mask = torch.zeros(len(trees), q, q, dtype=torch.bool)
    for s, parents in enumerate(trees):
        for i in range(len(parents)):
            mask[s, i, ancestors_and_self(parents, i)] = True
    return mask


def cached_key(cache: torch.Tensor, table: torch.Tensor, s: int, index: int) -> torch.Tensor:
    block_size = cache.shape[1]
    return cache[int(table[s, index // block_size]), index % block_size]   # [Hkv, D]


def dense_tree_reference(q, k_cache, v_cache, table, trees, prefix_lens, scale):
    """Each query's key set written out: cache indices 0 .. P-1, then P + j for every ancestor-or-self j."""
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros(q.shape, dtype=torch.float32)
    token = 0
    for s, (parents, prefix) in enumerate(zip(trees, prefix_lens)):
        for i in range(len(parents)):
            indices = list(range(prefix)) + [prefix + j for j in sorted(ancestors_and_self(parents, i))]
            keys = torch.stack([cached_key(k_cache, table, s, p) for p in indices]).float()     # [n, Hkv, D]
            values = torch.stack([cached_key(v_cache, table, s, p) for p in indices]).float()
            for h in range(num_heads):
                probs = torch.softmax(keys[:, h // group] @ q[token, h].float() * scale, dim=0)
                out[token, h] = probs @ values[:, h // group]
            token += 1
    return out


def tree_problem(trees, prefix_lens, num_kv_heads, group, head_dim, block_size, dtype, seed):
    """Queries and a paged cache (noise, the step's keys already written) for one tree step."""
    gen = torch.Generator().manual_seed(seed)
    query_lens = [len(t) for t in trees]
    kv_lens = [p + n for p, n in zip(prefix_lens, query_lens)]
    k_cache, v_cache, table = random_paged_cache(kv_lens, num_kv_heads, head_dim, block_size, dtype, gen)
    q = torch.randn(sum(query_lens), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    return q, k_cache, v_cache, table, start_locs(query_lens), torch.tensor(kv_lens, dtype=torch.int32)


def tree_batch(trees, prefix_lens, tables, block_size):
    """A ForwardBatch for a tree step: consecutive cache slots, rotary positions start + depth, the tree's mask."""
    from kestrel.batch import build_forward_batch
    batch = build_forward_batch([[1] * len(t) for t in trees], prefix_lens, tables, block_size)
    positions = torch.tensor([p + d for t, p in zip(trees, prefix_lens) for d in depths(t)], dtype=torch.int64)
    return dataclasses.replace(batch, positions=positions, tree_mask=tree_mask_of(trees))


# Sequences of different prefix lengths (one empty: the root is the first cached token) and tree sizes, so the
# mask is padded, and the step straddles block boundaries.
TREES_SEED = 11
PREFIX_LENS = [23, 5, 40, 0]
TREE_SIZES = [8, 3, 6, 5]


def random_trees(sizes: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [random_parents(n, gen) for n in sizes]


# ------------------------------------------------------------------------------------------------ the oracle

def test_random_parents_are_bfs_ordered_trees():
    for trees in (random_trees([8] * 20, seed) for seed in range(5)):
        for parents in trees:
            assert parents[0] == -1 and all(0 <= parents[i] < i for i in range(1, len(parents)))
            assert depths(parents) == sorted(depths(parents))   # BFS: depth never decreases


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("num_kv_heads,group,head_dim", [(2, 1, 32), (1, 4, 64)])
def test_torch_ref_tree_step_sees_the_prefix_and_exactly_its_ancestors(seed, num_kv_heads, group, head_dim):
    from kestrel.attention import torch_ref
    trees = random_trees(TREE_SIZES, TREES_SEED + seed)
    q, k_cache, v_cache, table, qsl, lens = tree_problem(trees, PREFIX_LENS, num_kv_heads, group, head_dim, 16,
                                                         torch.float32, seed)
    out = torch_ref.paged_attention(q, k_cache, v_cache, table, qsl, lens, max(TREE_SIZES), int(lens.max()), 0.2,
                                    tree_mask=tree_mask_of(trees))
    want = dense_tree_reference(q, k_cache, v_cache, table, trees, PREFIX_LENS, 0.2)
    torch.testing.assert_close(out, want, **scaled(TOLERANCE[torch.float32], want))


def test_torch_ref_of_a_chain_tree_is_the_causal_step():
    from kestrel.attention import torch_ref
    trees = [chain_parents(n) for n in TREE_SIZES]
    q, k_cache, v_cache, table, qsl, lens = tree_problem(trees, PREFIX_LENS, 2, 2, 64, 16, torch.float32, 5)
    args = (q, k_cache, v_cache, table, qsl, lens, max(TREE_SIZES), int(lens.max()), 0.125)
    causal = torch_ref.paged_attention(*args)
    assert torch.equal(torch_ref.paged_attention(*args, tree_mask=tree_mask_of(trees)), causal)


def test_torch_backend_reads_the_tree_mask_not_the_positions():
    """Through the backend, with positions start + depth (several nodes share one): the result is the dense
    reference, so nothing derives visibility from positions."""
    from kestrel.attention.torch_ref import TorchAttentionBackend
    gen = torch.Generator().manual_seed(7)
    block_size, num_kv_heads, head_dim, num_heads = 16, 2, 32, 4
    trees = random_trees([7, 4], 3)
    prefix_lens = [18, 9]
    tables = [[3, 0], [1]]
    k_cache = torch.randn(4, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(4, block_size, num_kv_heads, head_dim, generator=gen)
    batch = tree_batch(trees, prefix_lens, tables, block_size)
    assert batch.positions.tolist() != list(range(18, 25)) + list(range(9, 13))
    q = torch.randn(batch.num_tokens, num_heads, head_dim, generator=gen)
    k = torch.randn(batch.num_tokens, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(batch.num_tokens, num_kv_heads, head_dim, generator=gen)
    out = TorchAttentionBackend().forward(q, k, v, k_cache, v_cache, batch, 0.3)
    want = dense_tree_reference(q, k_cache, v_cache, batch.block_table, trees, prefix_lens, 0.3)
    torch.testing.assert_close(out, want, **scaled(TOLERANCE[torch.float32], want))


def test_backends_say_whether_they_take_tree_masks():
    from kestrel.attention.base import AttentionBackend
    from kestrel.attention.flashinfer_backend import FlashInferAttentionBackend
    from kestrel.attention.torch_ref import TorchAttentionBackend
    from kestrel.attention.triton_backend import TritonAttentionBackend
    assert TorchAttentionBackend().supports_tree_mask()
    assert TritonAttentionBackend().supports_tree_mask()
    assert FlashInferAttentionBackend.supports_tree_mask is AttentionBackend.supports_tree_mask   # False


def test_forward_batch_moves_its_tree_mask():
    trees = random_trees([3, 2], 0)
    batch = tree_batch(trees, [4, 6], [[0], [1]], 16)
    moved = batch.to(torch.device("cpu"))
    assert torch.equal(moved.tree_mask, batch.tree_mask)
    assert dataclasses.replace(batch, tree_mask=None).to(torch.device("cpu")).tree_mask is None


# ------------------------------------------------------------------------------------------------ triton

TRITON_CASES = [  # (num_kv_heads, group, head_dim, dtype)
    (2, 1, 64, torch.float32),
    (1, 4, 32, torch.float32),
    (2, 2, 64, torch.float16),
    (1, 2, 32, torch.bfloat16),
]


@interpreted_only
@pytest.mark.parametrize("num_kv_heads,group,head_dim,dtype", TRITON_CASES)
def test_triton_extend_with_a_tree_mask_matches_torch_ref(num_kv_heads, group, head_dim, dtype):
    from kestrel.attention import torch_ref
    from kestrel.kernels.triton import paged_attention
    trees = random_trees(TREE_SIZES, TREES_SEED + head_dim + group)
    q, k_cache, v_cache, table, qsl, lens = tree_problem(trees, PREFIX_LENS, num_kv_heads, group, head_dim, 16,
                                                         dtype, head_dim + group)
    mask = tree_mask_of(trees)
    out = paged_attention.extend_attention(q, k_cache, v_cache, table, qsl, lens, max(TREE_SIZES), 0.15, mask)
    ref = torch_ref.paged_attention(q, k_cache, v_cache, table, qsl, lens, max(TREE_SIZES), int(lens.max()), 0.15,
                                    tree_mask=mask)
    torch.testing.assert_close(out.float(), ref.float(), **scaled(TOLERANCE[dtype], ref.float()))


@interpreted_only
def test_triton_extend_of_a_chain_tree_is_its_causal_step():
    from kestrel.kernels.triton import paged_attention
    trees = [chain_parents(n) for n in TREE_SIZES]
    q, k_cache, v_cache, table, qsl, lens = tree_problem(trees, PREFIX_LENS, 2, 2, 32, 16, torch.float32, 9)
    args = (q, k_cache, v_cache, table, qsl, lens, max(TREE_SIZES), 0.125)
    causal = paged_attention.extend_attention(*args)
    tree = paged_attention.extend_attention(*args, tree_mask=tree_mask_of(trees))
    torch.testing.assert_close(tree, causal, **scaled(TOLERANCE[torch.float32], causal))


@interpreted_only
def test_triton_backend_matches_torch_backend_on_a_tree_step():
    """The whole backend road (K/V write, then attention) with positions start + depth."""
    from kestrel.attention.torch_ref import TorchAttentionBackend
    from kestrel.attention.triton_backend import TritonAttentionBackend
    gen = torch.Generator().manual_seed(12)
    block_size, num_kv_heads, head_dim, num_heads = 16, 2, 64, 4
    trees = random_trees([8, 2, 5], 4)
    prefix_lens = [30, 14, 1]
    tables = [[5, 2, 7], [0, 3], [6]]
    noise = (torch.randn(8, block_size, num_kv_heads, head_dim, generator=gen),
             torch.randn(8, block_size, num_kv_heads, head_dim, generator=gen))
    caches = {name: tuple(c.clone() for c in noise) for name in ("torch", "triton")}
    backends = {"torch": TorchAttentionBackend(), "triton": TritonAttentionBackend()}
    batch = tree_batch(trees, prefix_lens, tables, block_size)
    q = torch.randn(batch.num_tokens, num_heads, head_dim, generator=gen)
    k = torch.randn(batch.num_tokens, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(batch.num_tokens, num_kv_heads, head_dim, generator=gen)
    outs = {name: backend.forward(q, k, v, *caches[name], batch, 0.125) for name, backend in backends.items()}
    torch.testing.assert_close(outs["triton"], outs["torch"],
                           **scaled(TOLERANCE[torch.float32], outs["torch"]))
    assert torch.equal(caches["triton"][0], caches["torch"][0])
