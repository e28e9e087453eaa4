"""Warm-up: the step shapes first traffic can reach, run once at startup so that none of their kernels is built while
requests wait (issue 51: the first burst after ready as fast as the next).

A Triton kernel is built once per specialisation: its constexprs (a GEMM's tile table picks them from the row
count), its pointer dtypes, and for every integer argument whether it equals 1 and whether it is divisible by 16.
The graphs captured at startup cover decode steps, verify steps and a lone sequence's prompt chunk; everything else
runs eagerly (forward/runner.py), and its integer arguments are counts the scheduler decides: sequences in the
step, query tokens a sequence and in all, the block-table width, the rows wanting logits. So the warm-up runs

    the class matrix   sequences x query tokens each x context blocks, each in {1, 2, 16}: every "1", "16k" and
                       "neither" class of those counts (2 stands for any count neither 1 nor divisible by 16),
                       with and without logits rows
    the row ladder     2^i and 2^i + 1 tokens in all (two sequences or more) and max_num_batched_tokens: every GEMM
                       tile choice made by row count (kernels/triton/fp8_block_gemm.py's table, the fused MoE's
                       buckets) and the allocator's largest step, which the activation profile freed again

through ModelRunner.execute, the engine's own entry, so each step takes the road a real one of its shape takes. On
the CPU nothing compiles: one tiny prefill and decode there (the old warm-up) keeps CPU startup short. Every step
writes only into the blocks it names, all taken modulo the cache's size: a compile worker's cache has two blocks,
and whatever the warm-up leaves in a block is overwritten before any request reads it (a block is written before
it is read, or it is not in a request's table).
"""
from __future__ import annotations

import itertools

import torch

from kestrel.batch import SequenceChunk
from kestrel.forward.runner import ModelRunner

CLASS_COUNTS = (1, 2, 16)   # Triton's integer classes: equals 1, divisible by 16, neither


def class_matrix(block_size: int, max_model_len: int) -> list[list[SequenceChunk]]:
    """Steps of every (sequences, query tokens each, context blocks, logits wanted) class, smallest counts."""
    steps = []
    for seqs, query, blocks, logits in itertools.product(CLASS_COUNTS, CLASS_COUNTS, CLASS_COUNTS, (True, False)):
        kv_len = min(max_model_len, max(query, (blocks - 1) * block_size + 1))
        start = kv_len - query
        if start < 0:
            continue
        steps.append([SequenceChunk(seq_id=-1 - s, tokens=[0] * query, start=start,
                                    block_ids=list(range(-(-kv_len // block_size))), wants_logits=logits)
                      for s in range(seqs)])
    return steps


def row_ladder(max_tokens: int, block_size: int, max_model_len: int) -> list[list[SequenceChunk]]:
    """Steps of 2^i and 2^i + 1 tokens in all (i >= 5) and of max_tokens, as prompt chunks of at least two
    sequences (a lone one would replay a prefill graph) of at most max_model_len tokens each."""
    steps = []
    rungs = sorted({r for i in range(5, max_tokens.bit_length()) for r in (1 << i, (1 << i) + 1)
                    if r <= max_tokens} | {max_tokens})
    for rows in rungs:
        if rows >= 2:
            lengths = split_evenly(rows, max(2, -(-rows // max_model_len)))
            steps.append([SequenceChunk(seq_id=-1 - s, tokens=[0] * n, start=0,
                                        block_ids=list(range(-(-n // block_size)))) for s, n in enumerate(lengths)])
    return steps


def split_evenly(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def warm_up_steps(block_size: int, max_tokens: int, max_model_len: int) -> list[list[SequenceChunk]]:
    return class_matrix(block_size, max_model_len) + row_ladder(max_tokens, block_size, max_model_len)


def warm_up(runner: ModelRunner, block_size: int, max_tokens: int = 0, max_model_len: int = 0,
            full: bool | None = None) -> int:
    """Run the warm-up's eager steps (full: the default on CUDA, given max_tokens and max_model_len; the steps a
    captured graph replays were built by their capture) or one tiny prefill + decode; returns the steps run."""
    if full is None:
        full = runner.device.type == "cuda"
    if full and max_tokens and max_model_len:
        steps = [s for s in warm_up_steps(block_size, max_tokens, max_model_len) if not runner.replays(s)]
    else:
        steps = [[SequenceChunk(-1, [0, 0], 0, [0])], [SequenceChunk(-1, [0], 2, [0])]]
    num_blocks = runner.kv_cache.shape[2]
    for chunks in steps:
        for chunk in chunks:
            chunk.block_ids = [b % num_blocks for b in chunk.block_ids]
        runner.execute(chunks)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    return len(steps)
