"""A decode graph's head in one kernel: new block-table entries, the batch's block-table rows, its input tokens and
their embeddings.

Before layer 0, a graph step (forward/decode_graphs.py) ran four small torch kernels back to back: index_put of the
new (row, col, block) entries into the persistent tables, index_select of the batch's rows, index_select of the
input tokens out of the packed buffer, and the embedding lookup; on the 8B bs1 step that was ~9.5 us
(H200: 2.7 + 2.4 + 2.1 + 2.4; 11.3 us with graphs up to 128 rows, whose index_put scatters 256
update slots), most of it launch latency and dependent loads. Here one program per batch row does all four, in
three dependent round trips (its packed fields; the token and the table row; the embedding row):

    packed (int64): | prev_tokens | input_ids | input_src | positions | slots | kv_lens | rows | upd_* |
                                                  |                                |        |
    program i:  row = rows[i] --------------------+--------------------------------+--------+
                1. tables[row, upd_cols[u]] = upd_vals[u]   for every update u with upd_rows[u] == row
                   (a CTA barrier: the stores are then visible to the row copy below, same program)
                2. block_table[i, :n] = tables[row, :n]      n = ceil(kv_lens[i] / block_size): only the
                   columns the step can read (the rest of block_table keeps old, valid block ids)
                3. token t of the row: input_ids[t] = packed[input_src[t]]; embeds[t] = embed[input_ids[t]]

Rows are distinct for real sequences; padding rows share the dummy row, and their updates (col 0, block 0) write
the same value, so the programs never race on a value that matters. Unlike torch's index_put, the padding updates
land only when a padding row is in the launch; the dummy row holds valid block ids (zeros) either way.
`DecodeGraphs(fused=False)` (or KESTREL_FUSED_OPS=0) keeps the torch ops (`torch_step_inputs` in
forward/decode_graphs.py, also the CPU path).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _step_inputs_kernel(
    packed_ptr, tables_ptr, embed_ptr, block_table_ptr, input_ids_ptr, embeds_ptr,
    input_src_at, rows_at, kv_lens_at, upd_rows_at, upd_cols_at, upd_vals_at,
    num_table_writes, table_width, block_size,
    Q: tl.constexpr, QP: tl.constexpr, HIDDEN: tl.constexpr, UPD_BLOCK: tl.constexpr, COL_BLOCK: tl.constexpr,
    HID_BLOCK: tl.constexpr,
):
    # Three dependent round trips, not seven: every load that needs only the packed buffer goes first, the token
    # loads go out beside the table row's, and the embedding rows come last.
    i = tl.program_id(0)
    row = tl.load(packed_ptr + rows_at + i)
    kv_len = tl.load(packed_ptr + kv_lens_at + i)
    u = tl.arange(0, UPD_BLOCK)                     # UPD_BLOCK >= num_table_writes: one load of each field
    um = u < num_table_writes
    urow = tl.load(packed_ptr + upd_rows_at + u, mask=um, other=-1)
    ucol = tl.load(packed_ptr + upd_cols_at + u, mask=um, other=0)
    uval = tl.load(packed_ptr + upd_vals_at + u, mask=um, other=0)
    j = tl.arange(0, QP)                            # the row's Q query tokens
    t = i * Q + j
    srcs = tl.load(packed_ptr + input_src_at + t, mask=j < Q, other=0)
    table_row = tables_ptr + row * table_width
    tl.store(table_row + ucol, uval, mask=urow == row)
    tl.debug_barrier()   # the row's new entries are visible to this program's threads before the copy
    tokens = tl.load(packed_ptr + srcs, mask=j < Q, other=0)
    n_blocks = (kv_len + block_size - 1) // block_size
    c = tl.arange(0, COL_BLOCK)
    c0 = 0
    while c0 < n_blocks:   # (a while loop: Triton's interpreter cannot take a runtime bound in range())
        cm = c0 + c < n_blocks
        blocks = tl.load(table_row + c0 + c, mask=cm)
        tl.store(block_table_ptr + i.to(tl.int64) * table_width + c0 + c, blocks, mask=cm)
        c0 += COL_BLOCK
    tl.store(input_ids_ptr + t, tokens, mask=j < Q)
    h = tl.arange(0, HID_BLOCK)
    for h0 in tl.static_range(0, HIDDEN, HID_BLOCK):
        hm = (j[:, None] < Q) & (h0 + h[None, :] < HIDDEN)
        x = tl.load(embed_ptr + tokens[:, None] * HIDDEN + h0 + h[None, :], mask=hm)
        tl.store(embeds_ptr + t[:, None].to(tl.int64) * HIDDEN + h0 + h[None, :], x, mask=hm)


def step_inputs(packed: torch.Tensor, layout: dict[str, tuple[int, int]], tables: torch.Tensor,
                embed: torch.Tensor, block_table: torch.Tensor, bs: int, q: int, num_table_writes: int,
                block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(block_table[:bs], input_ids [bs * q], embeds [bs * q, hidden]) for the first bs rows of `packed`; writes
    the first num_table_writes updates into `tables`. `block_table` ([>= bs, W], W = tables.shape[1]) is the caller's
    static buffer: columns past a row's blocks keep what they held, so it must start as valid block ids (zeros)."""
    width, hidden = tables.shape[1], embed.shape[1]
    qp = triton.next_power_of_2(q)
    assert block_table.shape[1] == width and block_table.dtype == tables.dtype and packed.dtype == torch.int64
    input_ids = torch.empty(bs * q, dtype=packed.dtype, device=packed.device)
    embeds = torch.empty(bs * q, hidden, dtype=embed.dtype, device=embed.device)
    _step_inputs_kernel[(bs,)](
        packed, tables, embed, block_table, input_ids, embeds,
        layout["input_src"][0], layout["rows"][0], layout["kv_lens"][0],
        layout["upd_rows"][0], layout["upd_cols"][0], layout["upd_vals"][0],
        num_table_writes, width, block_size,
        Q=q, QP=qp, HIDDEN=hidden, UPD_BLOCK=triton.next_power_of_2(max(num_table_writes, 16)), COL_BLOCK=64,
        HID_BLOCK=max(16, min(2048 // qp, triton.next_power_of_2(hidden))), num_warps=4,
    )
    return block_table[:bs], input_ids, embeds
