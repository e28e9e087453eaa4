"""A decode graph's input bookkeeping in one kernel (experiment, off by default: KESTREL_FUSED_GRAPH_INPUTS=1).

Every graph step (engine/cuda_graphs.py) otherwise starts with three torch launches on the packed input buffer
`dev` (cuda_graphs.graph_inputs_torch, the reference this kernel is tested against):

    tables.index_put_((upd_rows, upd_cols), upd_vals)    blocks appended since each row's last graph step
    block_table = tables.index_select(0, rows)           the batch's rows of the persistent tables
    input_ids = dev.index_select(0, input_src)           each token: from the host, or the last step's argmax

On the H200 they take 3.2 + 2.1 + 2.1 us of a Qwen3-0.6B bs1 step (BENCHMARKS.md, session 7), each a full launch
boundary. graph_inputs does all three in one launch, one program per batch row i:

    r = rows[i]
    block_table[i, :] = tables[r, :]                       in chunks of COPY_BLOCK columns
    barrier (every thread's copy stores first)
    for each update (r, c, v) naming row r: block_table[i, c] = v; tables[r, c] = v (persisted)
    input_ids[i * Q .. i * Q + Q - 1] = dev[input_src[i * Q ..]]

A program applies its own row's updates to its own copy, so no program waits on another's writes. That covers
every update because the host sends updates only for rows of the batch (engine/cuda_graphs.py `_launch_rows`; the
overflow past the inline slots is written before the replay), and the padding updates name the dummy row, which
padding batch rows read. Two programs share a row only when both are padding (the dummy row), and they write the
same values. Each program reads the update triples once as one vector (2 * max_bs slots).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

COPY_BLOCK = 512   # block-table columns copied per loop step (4 KB of int64)


@triton.jit
def _graph_inputs_kernel(
    tables_ptr, dev_ptr, rows_ptr, src_ptr, upd_rows_ptr, upd_cols_ptr, upd_vals_ptr, block_table_ptr, ids_ptr,
    stride_t, stride_bt,
    WIDTH: tl.constexpr, NUM_UPDATES: tl.constexpr,   # fixed per runner; constexpr bounds also suit the interpreter
    Q: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_U: tl.constexpr, BLOCK_W: tl.constexpr,
):
    i = tl.program_id(0)
    r = tl.load(rows_ptr + i)
    src_row = tables_ptr + r * stride_t
    dst_row = block_table_ptr + i.to(tl.int64) * stride_bt
    for c0 in range(0, WIDTH, BLOCK_W):   # a loop, not unrolled: WIDTH can be thousands of blocks
        cols = c0 + tl.arange(0, BLOCK_W)
        live = cols < WIDTH
        tl.store(dst_row + cols, tl.load(src_row + cols, mask=live, other=0), mask=live)
    # This row's updates over the copy: the barrier orders every thread's copy stores before the update stores
    # (which may hit the same addresses), so the updates win.
    tl.debug_barrier()
    u = tl.arange(0, BLOCK_U)
    u_live = u < NUM_UPDATES
    mine = (tl.load(upd_rows_ptr + u, mask=u_live, other=-1) == r) & u_live
    u_cols = tl.load(upd_cols_ptr + u, mask=mine, other=0)
    u_vals = tl.load(upd_vals_ptr + u, mask=mine, other=0)
    tl.store(dst_row + u_cols, u_vals, mask=mine)
    tl.store(src_row + u_cols, u_vals, mask=mine)   # persisted for later steps
    t = tl.arange(0, BLOCK_Q)
    t_live = t < Q
    tok = i.to(tl.int64) * Q + t
    src = tl.load(src_ptr + tok, mask=t_live, other=0)
    tl.store(ids_ptr + tok, tl.load(dev_ptr + src, mask=t_live, other=0), mask=t_live)


def graph_inputs(tables: torch.Tensor, dev: torch.Tensor, rows: torch.Tensor, input_src: torch.Tensor,
                 upd_rows: torch.Tensor, upd_cols: torch.Tensor, upd_vals: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """cuda_graphs.graph_inputs_torch in one launch: tables [R, W] (updated in place), dev the packed buffer,
    rows [B], input_src [B * Q] (indices into dev) and the update triples [U]: all int64, views of dev allowed.
    Returns (block_table [B, W], input_ids [B * Q])."""
    bs, width = rows.shape[0], tables.shape[1]
    assert input_src.shape[0] % max(bs, 1) == 0, "input_src holds Q tokens per row"
    q = input_src.shape[0] // max(bs, 1)
    for t in (tables, dev, rows, input_src, upd_rows, upd_cols, upd_vals):
        assert t.dtype == torch.int64 and t.stride(-1) == 1, "int64 tensors with a unit last stride"
    assert upd_rows.shape == upd_cols.shape == upd_vals.shape
    block_table = torch.empty(bs, width, dtype=torch.int64, device=tables.device)
    input_ids = torch.empty(bs * q, dtype=torch.int64, device=tables.device)
    if bs == 0:
        return block_table, input_ids
    _graph_inputs_kernel[(bs,)](
        tables, dev, rows, input_src, upd_rows, upd_cols, upd_vals, block_table, input_ids,
        tables.stride(0), block_table.stride(0), WIDTH=width, NUM_UPDATES=upd_rows.shape[0],
        Q=q, BLOCK_Q=triton.next_power_of_2(q), BLOCK_U=triton.next_power_of_2(max(upd_rows.shape[0], 1)),
        BLOCK_W=min(triton.next_power_of_2(width), COPY_BLOCK), num_warps=4,
    )
    return block_table, input_ids
