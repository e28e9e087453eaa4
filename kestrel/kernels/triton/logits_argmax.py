"""The decode graph's tail in one kernel: lm_head's logits to float32 and each row's argmax.

In a bs1 decode step torch spends two launches here: a cast kernel (`.float()`, 4.2 us on the H200) and an argmax
reduce over the vocabulary that takes 8 us for Qwen3-0.6B's 151,936 logits and 28 us for Llama-3.1-8B's 128,256.
Here one launch does both, one program per (row, chunk of BLOCK logits):

    logits [rows, V] (model dtype) --load chunk--> store fp32 chunk --> (chunk max, first index of it)
                                                                                   |
    partial_max / partial_idx [rows, MAX_CHUNKS] <---------------------------------+
    counters [rows] int32: each program bumps its row's counter (acq_rel); the one that sees chunks - 1 is the
    last, reads the row's partials and writes the token, then puts the counter back to 0 for the next launch.

The answer is torch.argmax's: the first index of the maximum (ties go to the lower chunk, then the lower index
inside it). NaN counts as larger than every number, as in torch; only a row holding both NaN and +inf may differ
(torch picks the first NaN, this the first of either). On by default in the decode graphs (forward/decode_graphs.py): on the H200
the bs1 step went 0.710 -> 0.700 ms on the 0.6B (-1.5%) and 4.380 -> 4.340 ms on the 8B (-0.9%);
`DecodeGraphs(fused=False)` (or KESTREL_FUSED_OPS=0) keeps torch's cast + argmax.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.kernels.triton.pdl import launch_options, pdl_wait

BLOCK = 4096          # logits per program: 16 KB of bf16 in, 16 KB of fp32 out
MAX_CHUNKS = 64       # vocabularies up to 262,144 logits

ArgmaxScratch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]   # (partial_max, partial_idx, counters)


def alloc_argmax_scratch(max_rows: int, device: torch.device) -> ArgmaxScratch:
    """Scratch for up to max_rows rows; the counters start at 0 and every launch leaves them at 0."""
    return (torch.empty(max_rows, MAX_CHUNKS, dtype=torch.float32, device=device),
            torch.empty(max_rows, MAX_CHUNKS, dtype=torch.int32, device=device),
            torch.zeros(max_rows, dtype=torch.int32, device=device))


@triton.jit
def _logits_argmax_kernel(
    logits_ptr, out_ptr, tokens_ptr, part_max_ptr, part_idx_ptr, counter_ptr,
    V, stride_l, stride_o,
    NUM_CHUNKS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_C: tl.constexpr, MAX_CHUNKS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    pdl_wait(USE_PDL)   # the logits come from the kernel before this one
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = cols < V
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_l + cols, mask=mask, other=float("-inf")).to(tl.float32)
    tl.store(out_ptr + row.to(tl.int64) * stride_o + cols, x, mask=mask)
    key = tl.where(x != x, float("inf"), x)   # NaN above everything, as torch.argmax ranks it
    best = tl.max(key, 0)
    first = tl.min(tl.where(key == best, cols, V), 0)   # the first index holding the chunk's maximum
    part = row * MAX_CHUNKS + chunk
    tl.store(part_max_ptr + part, best)
    tl.store(part_idx_ptr + part, first)
    tl.debug_barrier()   # every thread's partial stores precede the release atomic
    done = tl.atomic_add(counter_ptr + row, 1, sem="acq_rel")
    if done == NUM_CHUNKS - 1:   # the last chunk of this row to finish: reduce the row's partials
        chunks = tl.arange(0, BLOCK_C)
        live = chunks < NUM_CHUNKS
        maxes = tl.load(part_max_ptr + row * MAX_CHUNKS + chunks, mask=live, other=float("-inf"),
                        cache_modifier=".cg")
        idxs = tl.load(part_idx_ptr + row * MAX_CHUNKS + chunks, mask=live, other=0, cache_modifier=".cg")
        top = tl.max(maxes, 0)
        # chunks hold increasing index ranges, so the smallest index among the chunks at the maximum is the first
        token = tl.min(tl.where(live & (maxes == top), idxs, V), 0)
        tl.store(tokens_ptr + row, token.to(tl.int64))
        tl.store(counter_ptr + row, 0)


def logits_argmax(logits: torch.Tensor, tokens: torch.Tensor, scratch: ArgmaxScratch,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """logits [rows, V] (any float dtype, unit last stride) -> float32 copy [rows, V] (into `out` when given, e.g.
    a buffer every graph bucket shares); tokens [rows] int64 receive each row's argmax. Launches sharing `scratch`
    must be stream-ordered (each leaves the counters at 0)."""
    rows, vocab = logits.shape
    part_max, part_idx, counters = scratch
    num_chunks = triton.cdiv(vocab, BLOCK)
    assert logits.stride(-1) == 1, "logits need a unit last stride"
    assert num_chunks <= MAX_CHUNKS, f"vocabulary {vocab} above {MAX_CHUNKS * BLOCK}"
    assert counters.shape[0] >= rows and part_max.shape[0] >= rows, f"scratch holds fewer than {rows} rows"
    assert tokens.dtype == torch.int64 and tokens.shape == (rows,), "tokens: [rows] int64"
    if out is None:
        out = torch.empty(rows, vocab, dtype=torch.float32, device=logits.device)
    assert out.shape == (rows, vocab) and out.dtype == torch.float32 and out.stride(-1) == 1, "out: [rows, V] fp32"
    if rows == 0:
        return out
    _logits_argmax_kernel[(rows, num_chunks)](
        logits, out, tokens, part_max, part_idx, counters,
        vocab, logits.stride(0), out.stride(0),
        NUM_CHUNKS=num_chunks, BLOCK=BLOCK, BLOCK_C=triton.next_power_of_2(num_chunks), MAX_CHUNKS=MAX_CHUNKS,
        num_warps=4, **launch_options(logits.device),
    )
    return out
