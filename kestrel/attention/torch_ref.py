"""Reference attention in plain torch (CPU and CUDA): the oracle the fast backends are checked against.

An FP8 cache (kernels/kv_store.py) is dequantized as it is gathered: keys times k_scale, values times v_scale."""
from __future__ import annotations

import torch

from kestrel.attention.base import AttentionBackend
from kestrel.batch import ForwardBatch
from kestrel.kernels.kv_store import dequantize, effective_scales, store_kv, store_kv_unpadded  # noqa: F401 - the reference backend's write


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, max_kv_len: int) -> torch.Tensor:
    """[num_blocks, block_size, H, D] paged -> [S, max_kv_len, H, D] contiguous (padding holds junk)."""
    block_size = cache.shape[1]
    num_blocks = (max_kv_len + block_size - 1) // block_size
    table = block_table[:, :num_blocks].clamp(min=0).long()
    if cache.dtype.itemsize == 1:   # FP8: gathered as bytes (torch's indexing has no FP8 kernel on every device)
        dense = cache.view(torch.uint8)[table].view(cache.dtype)
    else:
        dense = cache[table]                              # [S, nb, bs, H, D]
    return dense.flatten(1, 2)[:, :max_kv_len]


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    query_start_loc: torch.Tensor, kv_lens: torch.Tensor, max_query_len: int, max_kv_len: int,
                    scale: float, tree_mask: torch.Tensor | None = None, k_scale: float = 1.0,
                    v_scale: float = 1.0) -> torch.Tensor:
    """Causal attention of ragged queries [T, Hq, D] over the paged cache; returns [T, Hq, D]. k_scale, v_scale:
    an FP8 cache's dequantization scales (ignored for any other cache dtype).

    With tree_mask [S, max_query_len, max_query_len] bool (base.py draws it), query i sees every key before the
    step and the step's key j iff tree_mask[s, i, j], instead of the step's keys 0 .. i."""
    if max_query_len == 1 and tree_mask is None:
        return decode_attention(q, k_cache, v_cache, block_table, kv_lens, max_kv_len, scale, k_scale, v_scale)
    num_seqs = kv_lens.shape[0]
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    device = q.device
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()
    # Scatter the ragged queries into a padded [S, max_q, Hq, D] block.
    token_seq = torch.repeat_interleave(torch.arange(num_seqs, device=device), q_lens)
    token_idx = torch.arange(q.shape[0], device=device) - query_start_loc[:-1].long()[token_seq]
    q_pad = q.new_zeros(num_seqs, max_query_len, num_heads, head_dim)
    q_pad[token_seq, token_idx] = q
    keys = dequantize(gather_kv(k_cache, block_table, max_kv_len), k_scale, q.dtype)
    values = dequantize(gather_kv(v_cache, block_table, max_kv_len), v_scale, q.dtype)
    group = num_heads // num_kv_heads
    keys = keys.repeat_interleave(group, dim=2)           # GQA: each kv head serves `group` query heads
    values = values.repeat_interleave(group, dim=2)
    # Query i of sequence s sits at position kv_len - q_len + i and sees keys at positions <= that.
    q_pos = (kv_lens.long() - q_lens)[:, None] + torch.arange(max_query_len, device=device)[None, :]
    k_pos = torch.arange(max_kv_len, device=device)
    mask = k_pos[None, None, :] <= q_pos[:, :, None]      # [S, max_q, max_kv]
    if tree_mask is not None:
        # Key at cache index p is the step's key j = p - (kv_len - q_len); those before the step (j < 0) stay
        # visible, the step's own keys are visible as the tree says.
        step_start = (kv_lens.long() - q_lens)[:, None]
        j = k_pos[None, :] - step_start                   # [S, max_kv]
        in_step = (j >= 0) & (j < q_lens[:, None])
        tree_bits = tree_mask.gather(2, j.clamp(0, max_query_len - 1)[:, None, :].expand(-1, max_query_len, -1))
        mask = (j < 0)[:, None, :] | (in_step[:, None, :] & tree_bits)
    mask &= k_pos[None, None, :] < kv_lens.long()[:, None, None]
    scores = torch.einsum("sqhd,skhd->shqk", q_pad.float(), keys.float()) * scale
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # fully masked rows are padding
    # Slots past a sequence's length hold whatever their block last held: zero them, since 0 * NaN is NaN.
    valid = (k_pos[None, :] < kv_lens.long()[:, None])[:, :, None, None]
    out = torch.einsum("shqk,skhd->sqhd", probs, values.float().masked_fill(~valid, 0.0))
    return out[token_seq, token_idx].to(q.dtype)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                     kv_lens: torch.Tensor, max_kv_len: int, scale: float, k_scale: float = 1.0,
                     v_scale: float = 1.0) -> torch.Tensor:
    """paged_attention for one query token a sequence, [S, Hq, D]: the query heads grouped by their KV head, so the
    gathered keys and values are read as they are, never repeated per query head (a 245-sequence CPU decode step
    spent most of its time copying them)."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    keys = dequantize(gather_kv(k_cache, block_table, max_kv_len), k_scale, torch.float32).transpose(1, 2)
    values = dequantize(gather_kv(v_cache, block_table, max_kv_len), v_scale, torch.float32).transpose(1, 2)
    valid = torch.arange(max_kv_len, device=q.device)[None, :] < kv_lens.long()[:, None]   # [S, K]
    values = values.masked_fill(~valid[:, None, :, None], 0.0)   # junk past a sequence's end: 0 * NaN is NaN
    qg = q.float().view(num_seqs, num_kv_heads, group, head_dim)
    scores = torch.matmul(qg, keys.transpose(2, 3)) * scale                           # [S, Hkv, G, K]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.matmul(probs, values).reshape(num_seqs, num_heads, head_dim).to(q.dtype)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def supports_prewritten_kv(self) -> bool:
        return True

    def supports_tree_mask(self) -> bool:
        return True

    def forward(self, q, k, v, k_cache, v_cache, batch: ForwardBatch, scale: float, k_scale: float = 1.0,
                v_scale: float = 1.0) -> torch.Tensor:
        k_scale, v_scale = effective_scales(k_cache, k_scale, v_scale)
        if k is not None:   # None: the model's attention prologue already wrote this step's K/V
            store_kv(k, v, k_cache, v_cache, batch.slot_mapping, k_scale, v_scale)
        if q.device.type == "cpu" and batch.tree_mask is None and batch.max_query_len > 1 \
                and batch.kv_lens.numel() > 1:
            return _attend_in_groups(q, k_cache, v_cache, batch, scale, k_scale, v_scale)
        return paged_attention(q, k_cache, v_cache, batch.block_table, batch.query_start_loc, batch.kv_lens,
                               batch.max_query_len, batch.max_kv_len, scale, batch.tree_mask, k_scale, v_scale)


def _attend_in_groups(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch,
                      scale: float, k_scale: float, v_scale: float) -> torch.Tensor:
    """A mixed step on the CPU: the single-token rows together, each longer chunk alone. One padded call would
    cost sequences x longest chunk x longest context (a 600-token prompt beside 255 decodes: 256 x 600 x 700
    scores a head), where this costs what each sequence needs. CPU only: the lengths are read on the host."""
    starts = batch.query_start_loc.tolist()
    kv_lens = batch.kv_lens.tolist()
    singles = [s for s in range(len(kv_lens)) if starts[s + 1] - starts[s] == 1]
    groups = ([singles] if singles else []) + \
        [[s] for s in range(len(kv_lens)) if starts[s + 1] - starts[s] > 1]
    out = torch.empty_like(q)
    for seqs in groups:
        rows = torch.cat([torch.arange(starts[s], starts[s + 1]) for s in seqs])
        index = torch.tensor(seqs)
        lens = [starts[s + 1] - starts[s] for s in seqs]
        loc = torch.tensor([0] + lens, dtype=batch.query_start_loc.dtype).cumsum(0)
        out[rows] = paged_attention(q[rows], k_cache, v_cache, batch.block_table[index], loc,
                                    batch.kv_lens[index], max(lens), max(kv_lens[s] for s in seqs), scale,
                                    k_scale=k_scale, v_scale=v_scale)
    return out
