"""Multi-head latent attention over the latent cache (attention/mla.py): the absorbed form and the up-projected
form equal each other and a dense per-sequence computation written from the definition, on fresh random caches
with shuffled blocks, prefix-cached starts, ragged chunks and decode rows."""
from __future__ import annotations

import pytest
import torch

from kestrel.attention.mla import LatentAttention, rotate_interleaved, write_latent
from kestrel.batch import build_forward_batch
from tests.tolerances import scaled

TOL = dict(atol=1e-5, rtol=1e-5)   # float32; atol for values of order one, scaled() grows it with the reference

HEADS, NOPE, ROPE, V, RANK, BLOCK = 4, 16, 8, 12, 24, 4


def dense_reference(q_nope, q_pe, w_uk, w_uv, entries: list[torch.Tensor], query_lens: list[int], scale: float):
    """Per sequence: every cached latent up-projected, causal softmax attention, from the definition."""
    outs, start = [], 0
    for latent, q_len in zip(entries, query_lens):
        c_kv, k_pe = latent[:, :RANK], latent[:, RANK:]
        k = torch.cat([torch.einsum("kr,hnr->khn", c_kv, w_uk), k_pe[:, None].expand(-1, HEADS, -1)], dim=-1)
        v = torch.einsum("kr,hvr->khv", c_kv, w_uv)
        q = torch.cat([q_nope[start:start + q_len], q_pe[start:start + q_len]], dim=-1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        kv_len = latent.shape[0]
        q_pos = torch.arange(kv_len - q_len, kv_len)[:, None]
        scores = scores.masked_fill(torch.arange(kv_len)[None, :] > q_pos, float("-inf"))
        outs.append(torch.einsum("hqk,khv->qhv", scores.softmax(-1), v))
        start += q_len
    return torch.cat(outs)


def shuffled_block_tables(kv_lens: list[int], block: int, spare: int, gen: torch.Generator
                          ) -> tuple[list[list[int]], int]:
    """Each sequence's blocks drawn from a shuffled pool of exactly enough blocks plus `spare`: (tables, pool size)."""
    needed = [-(-n // block) for n in kv_lens]
    num_blocks = sum(needed) + spare
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for n in needed:
        tables.append(order[:n])
        order = order[n:]
    return tables, num_blocks


@pytest.mark.parametrize("query_lens,cached", [([5, 1, 9], [3, 11, 0]), ([1, 1, 1], [6, 0, 13]), ([12], [0])])
def test_absorbed_and_up_projected_forms_equal_the_definition(query_lens, cached):
    gen = torch.Generator().manual_seed(sum(query_lens) * 7 + sum(cached))
    kv_lens = [q + c for q, c in zip(query_lens, cached)]
    tables, num_blocks = shuffled_block_tables(kv_lens, BLOCK, 3, gen)
    cache = torch.randn(num_blocks, BLOCK, 1, RANK + ROPE, generator=gen)   # noise: unwritten slots are junk
    batch = build_forward_batch([[0] * q for q in query_lens], cached, tables, BLOCK)
    tokens = sum(query_lens)
    # the step's own latents, written as the model writes them
    write_latent(torch.randn(tokens, RANK + ROPE, generator=gen), cache, batch.slot_mapping)
    entries = [torch.stack([cache[t[p // BLOCK], p % BLOCK, 0] for p in range(n)]) for t, n in zip(tables, kv_lens)]
    q_nope = torch.randn(tokens, HEADS, NOPE, generator=gen)
    q_pe = torch.randn(tokens, HEADS, ROPE, generator=gen)
    w_uk = 0.3 * torch.randn(HEADS, NOPE, RANK, generator=gen)
    w_uv = 0.3 * torch.randn(HEADS, V, RANK, generator=gen)
    attn = LatentAttention(RANK, (NOPE + ROPE) ** -0.5)
    ref = dense_reference(q_nope, q_pe, w_uk, w_uv, entries, query_lens, attn.scale)
    torch.testing.assert_close(attn.absorbed(q_nope, q_pe, w_uk, w_uv, cache, batch), ref, **scaled(TOL, ref))
    if batch.max_query_len > 1:
        torch.testing.assert_close(attn.up_projected(q_nope, q_pe, w_uk, w_uv, cache, batch), ref,
                                   **scaled(TOL, ref))


def test_interleaved_rotary_rotates_each_pair_by_its_angle():
    """Pair (x[2i], x[2i+1]) turns by position * inv_freq[i]; the output lists the pairs' first then second
    coordinates (HF's order), which keeps every q . k."""
    rope, positions = 8, torch.tensor([0, 3, 17])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rope, 2).float() / rope))
    angles = positions[:, None].float() * inv_freq[None, :]
    table = torch.cat([angles.cos(), angles.sin()], dim=-1)
    table_full = torch.zeros(20, rope)
    table_full[positions] = table
    x = torch.randn(3, 2, rope)
    out = rotate_interleaved(x, positions, table_full)
    pairs = torch.complex(x[..., 0::2], x[..., 1::2]) * torch.polar(torch.ones_like(angles), angles)[:, None]
    torch.testing.assert_close(out, torch.cat([pairs.real, pairs.imag], dim=-1))
