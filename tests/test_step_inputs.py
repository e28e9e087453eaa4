"""The decode graph's fused head (kestrel/kernels/triton/step_inputs.py) against the torch ops it replaces
(engine/cuda_graphs.torch_step_inputs), run on CPU by Triton's interpreter on fresh random inputs: table updates
for batch rows and the dummy row, rows whose blocks span several column chunks, padded rows, tokens taken from
the host's input_ids or from the previous step's prev_tokens, one and several query tokens a row, and repeated
launches into one static block-table buffer (as graph replays do); plus its sm_90 build."""
from __future__ import annotations

import random

import pytest
import torch

from kestrel.forward.decode_graphs import packed_layout, torch_step_inputs
from tests.triton_interpreter import INTERPRETED, interpreted_only, run_file_under_interpreter

interpreted = interpreted_only("test_step_inputs_under_triton_interpreter")


@pytest.mark.slow   # a child pytest running the file's kernels in Triton's interpreter
@pytest.mark.skipif(INTERPRETED, reason="this is the interpreter child")
def test_step_inputs_under_triton_interpreter():
    run_file_under_interpreter(__file__, min_passed=2)   # all but the ones that skip in the child


def _random_step(rng: random.Random, max_bs: int, bs: int, q: int, max_rows: int, width: int, block_size: int,
                 vocab: int, max_table_writes: int) -> torch.Tensor:
    """A packed buffer as DecodeGraphs._launch_rows fills it: bs real rows, the rest of the bucket padding.
    Padding updates target the dummy row, whose contents nobody reads for a real row; the kernel writes them only
    when a padding row is in the launch, torch's index_put always, so the tests compare the other rows."""
    layout, size = packed_layout(max_bs, q, max_table_writes)
    packed = torch.zeros(size, dtype=torch.int64)

    def put(name: str, values: list[int]) -> None:
        packed[layout[name][0]:layout[name][0] + len(values)] = torch.tensor(values, dtype=torch.int64)

    dummy = max_rows
    rows = rng.sample(range(max_rows), bs) + [dummy] * (max_bs - bs)
    kv_lens = [rng.randint(q, width * block_size) for _ in range(bs)] + [q] * (max_bs - bs)
    put("rows", rows)
    put("kv_lens", kv_lens)
    put("prev_tokens", [rng.randrange(vocab) for _ in range(max_bs * q)])
    put("input_ids", [rng.randrange(vocab) for _ in range(max_bs * q)])
    ids_at, prev_at = layout["input_ids"][0], layout["prev_tokens"][0]
    put("input_src", [rng.choice((ids_at, prev_at)) + t for t in range(max_bs * q)])
    updates = []
    for row, kv_len in zip(rows[:bs], kv_lens):
        n_blocks = -(-kv_len // block_size)
        for col in rng.sample(range(n_blocks), min(n_blocks, rng.randint(0, 3))):
            updates.append((row, col, rng.randrange(1000)))
    updates = updates[:max_table_writes]
    updates += [(dummy, 0, 0)] * (max_table_writes - len(updates))
    rng.shuffle(updates)
    for name, col in (("upd_rows", 0), ("upd_cols", 1), ("upd_vals", 2)):
        put(name, [u[col] for u in updates])
    return packed


@interpreted
@pytest.mark.parametrize("q", [1, 3])
def test_matches_the_torch_ops_on_random_steps(q):
    from kestrel.kernels.triton.step_inputs import step_inputs
    rng = random.Random(7 + q)
    max_bs, max_rows, width, block_size, vocab, hidden = 8, 12, 150, 2, 50, 40   # 150 columns: 3 chunks of 64
    max_table_writes = 2 * max_bs
    layout, _ = packed_layout(max_bs, q, max_table_writes)
    embed = torch.randn(vocab, hidden).to(torch.bfloat16)
    tables = torch.randint(0, 1000, (max_rows + 1, width), dtype=torch.int64)
    tables_ref = tables.clone()
    block_table = torch.zeros(max_bs, width, dtype=torch.int64)   # the static buffer, reused launch after launch
    for bs in (1, 8, 5, 3):
        packed = _random_step(rng, max_bs, bs, q, max_rows, width, block_size, vocab, max_table_writes)
        bucket = max_bs if bs > 4 else 4
        before = block_table.clone()
        got = step_inputs(packed, layout, tables, embed, block_table, bucket, q, max_table_writes, block_size)
        want = torch_step_inputs(packed, layout, tables_ref, embed, None, bucket, q, max_table_writes, block_size)
        assert torch.equal(tables[:max_rows], tables_ref[:max_rows])   # see _random_step: the dummy row
        assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
        assert got[0].data_ptr() == block_table.data_ptr() and got[0].shape == (bucket, width)
        kv_lens = packed[layout["kv_lens"][0]:layout["kv_lens"][0] + bucket].tolist()
        for i, kv_len in enumerate(kv_lens):
            n = -(-kv_len // block_size)
            assert torch.equal(got[0][i, :n], want[0][i, :n]), f"bs {bs} row {i}"
            assert torch.equal(got[0][i, n:], before[i, n:]), "columns past the row's blocks must be left alone"


@pytest.mark.skipif(INTERPRETED, reason="builds the compiled kernel; the parent process runs it")
def test_step_inputs_kernel_builds_for_sm90():
    from kestrel.kernels.triton.step_inputs import _step_inputs_kernel
    from tests.sm90 import compile_for_sm90
    ptx = compile_for_sm90(_step_inputs_kernel, {"Q": 1, "QP": 1, "HIDDEN": 4096, "UPD_BLOCK": 256, "COL_BLOCK": 64, "HID_BLOCK": 2048},
                           {"packed_ptr": "*i64", "tables_ptr": "*i64", "block_table_ptr": "*i64",
                            "input_ids_ptr": "*i64"})
    # the row copy reads entries this program just stored: a CTA barrier between them, and no read-only-path load
    assert "bar.sync" in ptx
    assert "ld.global.nc" not in ptx
