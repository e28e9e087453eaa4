"""MLA's absorbed decode (kestrel/attention/mla.py) through paged_decode.py's split-K kernel, which is not changed.

The absorbed step is multi-query attention of head width kv_lora_rank + rope over the latent cache as stored,
whose values are the same rows (the output's first kv_lora_rank dims are the answer; its rope tail is the
softmax-weighted k_pe, junk the caller drops, read from the rows the keys already brought in).

The kernel runs one program per (sequence, kv head, split) over the GROUP query heads of that kv head, holding
q and the accumulator as [BLOCK_H, BLOCK_D] tiles (BLOCK_D = 1024 for a 576-wide latent). With all H heads on
the one latent head that is a [128, 1024] tile at DeepSeek-V3's 128 heads: far past the registers and shared
memory of an SM. So the latent is handed to the kernel as H / heads_per_program kv heads that are all the same
latent (an expanded view: head stride 0), and each program takes heads_per_program query heads. The programs of
one (sequence, split) read the same cache rows, which the L2 serves after the first.
"""
from __future__ import annotations

import torch

from kestrel.kernels.triton import paged_decode

HEADS_PER_PROGRAM = 16   # the kernel pads a program's heads to 16 rows for tl.dot anyway
# Compiled tiles: a 576-wide latent is a BLOCK_D of 1024, so K and V tiles of paged_decode's 32 keys are 64 KiB
# each in bf16, which two pipeline stages would double past an H100's 228 KiB of shared memory. 16 keys and one
# stage keep K, V and q at 32 KiB each, and 8 warps halve the registers a thread holds of the [16, 1024] fp32
# accumulator. Not yet tuned on a GPU (written without one).
LATENT_TILES = {"BLOCK_N": 16, "num_warps": 8, "num_stages": 1}


def head_groups(num_heads: int, heads_per_program: int = HEADS_PER_PROGRAM) -> int:
    """How many kv heads the latent is presented as: num_heads / g for the largest g <= heads_per_program that
    divides num_heads (the kernel needs equal groups)."""
    group = max(g for g in range(1, min(heads_per_program, num_heads) + 1) if num_heads % g == 0)
    return num_heads // group


def alloc_latent_partials(max_seqs: int, num_heads: int, width: int, device: torch.device,
                          heads_per_program: int = HEADS_PER_PROGRAM) -> paged_decode.DecodeScratch:
    """Split-K scratch for latent_decode_attention (static under CUDA graphs, as paged_decode's)."""
    return paged_decode.alloc_decode_partials(max_seqs, num_heads, head_groups(num_heads, heads_per_program), width,
                                              device)


def latent_decode_attention(
    q: torch.Tensor,              # [S, H, kv_lora_rank + rope]: the absorbed queries, one token a sequence
    latent_cache: torch.Tensor,   # [num_blocks, block_size, 1, kv_lora_rank + rope]
    block_table: torch.Tensor,    # [S, max_blocks] int32 or int64 (the decode graphs' tables are int64), -1 padded
    kv_lens: torch.Tensor,        # [S] on the device; 0 for a padded row (its output is 0)
    scale: float,
    partials: paged_decode.DecodeScratch | None = None,
    num_splits: int | None = None,
    heads_per_program: int = HEADS_PER_PROGRAM,
    latent_scale: float = 1.0,    # an FP8 latent cache's scale (kernels/kv_store.py); ignored for any other dtype
) -> torch.Tensor:                # [S, H, kv_lora_rank + rope]; the first kv_lora_rank dims are the attention
    """One launch, no host sync, so CUDA graphs capture it (pass static partials from alloc_latent_partials)."""
    assert latent_cache.shape[2] == 1, f"a latent cache has one head, not {latent_cache.shape[2]}"
    groups = head_groups(q.shape[1], heads_per_program)
    cache = latent_cache.expand(-1, -1, groups, -1)   # every "kv head" is the latent: no copy
    return paged_decode.decode_attention(q, cache, cache, block_table, kv_lens, scale, num_splits=num_splits,
                                         partials=partials, tiles=LATENT_TILES, k_scale=latent_scale,
                                         v_scale=latent_scale)
