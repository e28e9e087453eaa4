"""The fused graph-input kernel (kestrel/engine/graph_inputs.py) against the torch ops it replaces
(cuda_graphs.graph_inputs_torch), on CPU under Triton's interpreter: updates applied and persisted, rows gathered
across several column chunks, padding rows sharing the dummy row, Q tokens per row, and inputs read through
views of one packed buffer, as the graphs bind them."""
from __future__ import annotations

import pytest
import torch

from tests.triton_interpreter import INTERPRETED, interpreted_only, run_file_under_interpreter

interpreted = interpreted_only("test_graph_inputs_under_triton_interpreter")


@pytest.mark.skipif(INTERPRETED, reason="this is the interpreter child")
def test_graph_inputs_under_triton_interpreter():
    run_file_under_interpreter(__file__)


def views_of(dev: torch.Tensor, spans: list[tuple[int, int]]) -> list[torch.Tensor]:
    """(rows, input_src, upd_rows, upd_cols, upd_vals) as views of the packed buffer `dev`."""
    return [dev[start:start + n] for start, n in spans]


def packed_step(gen, num_rows: int, width: int, bs: int, q: int, max_updates: int):
    """(tables, dev, spans): a packed int64 buffer like CudaGraphRunner's with `bs` rows of which the last two are
    padding (the dummy row), and updates for some real rows, padded with (dummy, 0, 0) triples; spans locate
    (rows, input_src, upd_rows, upd_cols, upd_vals) in it (views_of)."""
    dummy = num_rows
    tables = torch.randint(0, 1000, (num_rows + 1, width), generator=gen)
    real = bs - 2
    rows = torch.randperm(num_rows, generator=gen)[:real].tolist() + [dummy, dummy]
    updates = []
    for row in rows[: real // 2 + 1]:                       # some real rows get new blocks, one several
        start = int(torch.randint(0, width - 3, (1,), generator=gen))
        for col in range(start, start + (3 if row == rows[0] else 1)):
            updates.append((row, col, 5000 + len(updates)))
    updates.append((rows[-3], width - 1, 7777))             # the last column of a row, in the last chunk
    assert len(updates) <= max_updates
    updates += [(dummy, 0, 0)] * (max_updates - len(updates))
    pool = torch.randint(0, 30000, (64,), generator=gen)    # tokens: the host's and the last step's argmax
    src = torch.randint(0, pool.numel(), (bs * q,), generator=gen)
    upd = torch.tensor(updates)
    dev = torch.cat([pool, src, torch.tensor(rows), upd[:, 0], upd[:, 1], upd[:, 2]])
    at = pool.numel()
    spans = [(at + bs * q, bs), (at, bs * q)]
    at += bs * q + bs
    spans += [(at + i * max_updates, max_updates) for i in range(3)]
    return tables, dev, spans


@interpreted
@pytest.mark.parametrize("width,bs,q,max_updates", [(1100, 6, 1, 16), (40, 5, 3, 8), (17, 4, 1, 64)])
def test_matches_the_torch_ops(width, bs, q, max_updates):
    from kestrel.engine.cuda_graphs import graph_inputs_torch
    from kestrel.engine.graph_inputs import graph_inputs
    gen = torch.Generator().manual_seed(width + bs)
    tables, dev, spans = packed_step(gen, num_rows=12, width=width, bs=bs, q=q, max_updates=max_updates)
    views = views_of(dev, spans)
    ref_tables = tables.clone()
    ref_block_table, ref_ids = graph_inputs_torch(ref_tables, dev, *views)
    block_table, input_ids = graph_inputs(tables, dev, *views)
    assert torch.equal(block_table, ref_block_table)
    assert torch.equal(input_ids, ref_ids)
    assert torch.equal(tables, ref_tables), "updates must persist in the tables"
    assert (block_table >= 5000).any(), "the step exercised no update"


@interpreted
def test_a_row_without_updates_is_copied_unchanged():
    from kestrel.engine.graph_inputs import graph_inputs
    tables = torch.arange(3 * 20).reshape(3, 20)
    dev = torch.tensor([42, 0, 1, 2, 2, 5, 99])   # token 42 | input_src 0 | rows 1, 2 | upd (2, 5, 99)
    block_table, input_ids = graph_inputs(tables, dev, dev[2:4], dev[1:2].repeat(2), dev[4:5], dev[5:6], dev[6:7])
    assert block_table[0].tolist() == list(range(20, 40))
    assert block_table[1, 5] == 99 and tables[2, 5] == 99 and tables[1].tolist() == list(range(20, 40))
    assert input_ids.tolist() == [42, 42]
