"""The CPU reference attention's two shortcuts (one query token a sequence; a mixed step split into its decodes and
each prompt chunk) against attention written out per sequence with torch's SDPA."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kestrel.attention.torch_ref import TorchAttentionBackend, paged_attention
from kestrel.batch import build_forward_batch
from tests.tolerances import scaled

BLOCK = 4


def per_sequence(q, k_cache, v_cache, tables, q_lens, kv_lens, scale):
    """Sequence by sequence: its keys read block by block, causal within its new tokens."""
    outs, start = [], 0
    group = q.shape[1] // k_cache.shape[2]
    for table, q_len, kv_len in zip(tables, q_lens, kv_lens):
        keys = torch.cat([k_cache[b] for b in table])[:kv_len].repeat_interleave(group, 1)
        values = torch.cat([v_cache[b] for b in table])[:kv_len].repeat_interleave(group, 1)
        qs = q[start:start + q_len]
        mask = torch.arange(kv_len)[None, :] <= torch.arange(kv_len - q_len, kv_len)[:, None]
        out = F.scaled_dot_product_attention(qs.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                                             attn_mask=mask, scale=scale)
        outs.append(out.transpose(0, 1))
        start += q_len
    return torch.cat(outs)


@pytest.mark.parametrize("kv_heads,group", [(2, 2), (1, 4), (4, 1)])
def test_decode_rows_equal_attention_per_sequence(kv_heads, group):
    g = torch.Generator().manual_seed(kv_heads * 10 + group)
    d, num_blocks = 16, 64
    k_cache = torch.randn(num_blocks, BLOCK, kv_heads, d, generator=g)
    v_cache = torch.randn(num_blocks, BLOCK, kv_heads, d, generator=g)
    kv_lens = [1, 9, 23, 4, 16]
    tables = torch.randperm(num_blocks, generator=g)[:30].view(5, 6)
    q = torch.randn(len(kv_lens), kv_heads * group, d, generator=g)
    got = paged_attention(q, k_cache, v_cache, tables, torch.arange(6, dtype=torch.int32),
                          torch.tensor(kv_lens, dtype=torch.int32), 1, max(kv_lens), 0.3)
    want = per_sequence(q, k_cache, v_cache, tables.tolist(), [1] * 5, kv_lens, 0.3)
    torch.testing.assert_close(got, want, **scaled(dict(atol=1e-5, rtol=1e-5), want))


def test_a_mixed_step_equals_attention_per_sequence():
    g = torch.Generator().manual_seed(7)
    kv_heads, heads, d, num_blocks = 2, 4, 16, 64
    k_cache = torch.zeros(num_blocks, BLOCK, kv_heads, d)
    v_cache = torch.zeros(num_blocks, BLOCK, kv_heads, d)
    # earlier tokens already in the cache; this step: two decodes, a 7-token chunk, a decode, a 3-token chunk
    context, new = [5, 0, 9, 12, 2], [1, 1, 7, 1, 3]
    tables = torch.randperm(num_blocks, generator=g)[:30].view(5, 6).tolist()
    for table, n in zip(tables, context):
        for pos in range(n):
            k_cache[table[pos // BLOCK], pos % BLOCK] = torch.randn(kv_heads, d, generator=g)
            v_cache[table[pos // BLOCK], pos % BLOCK] = torch.randn(kv_heads, d, generator=g)
    batch = build_forward_batch([[0] * n for n in new], context, tables, BLOCK)
    total = sum(new)
    q = torch.randn(total, heads, d, generator=g)
    k = torch.randn(total, kv_heads, d, generator=g)
    v = torch.randn(total, kv_heads, d, generator=g)
    got = TorchAttentionBackend().forward(q, k, v, k_cache, v_cache, batch, 0.25)
    want = per_sequence(q, k_cache, v_cache, tables, new, [c + n for c, n in zip(context, new)], 0.25)
    torch.testing.assert_close(got, want, **scaled(dict(atol=1e-5, rtol=1e-5), want))
