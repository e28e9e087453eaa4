r"""AttentionBackend: the interface every attention implementation (torch, triton, flashinfer) provides.

Paged KV cache, one pair of tensors per layer:

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
      token p of sequence s lives at block_table[s, p // block_size], offset p % block_size
      flat slot = block * block_size + offset   (slot_mapping holds these for the new tokens)

forward() first writes the step's new K/V into the cache at slot_mapping (slot -1: skip), then attends each
query token to every cached token of its sequence at or before its own position:
    query i of sequence s sits at position kv_lens[s] - query_len[s] + i.
A model whose fused attention prologue (kestrel/kernels/triton/attention_prologue.py) has already written the step's K/V passes
k = v = None instead; only backends whose supports_prewritten_kv() is True are handed that.

Tree verify steps (batch.tree_mask is not None; only backends whose supports_tree_mask() is True are handed one).
Sequence s's Q = query_len[s] query tokens are its last verified token (the root, node 0) and N = Q - 1 draft
nodes in BFS order. Their K/V sit at consecutive cache indices as usual, but their rotary positions are
start + depth, not start + i, so causality comes from the mask, never from batch.positions:

    cache index:  0 ........ P-1 | P      P+1    P+2    P+3   ...  P+Q-1        P = kv_lens[s] - query_len[s]
                  keys before the | node 0 node 1 node 2 node 3 ...               (the step's keys)
                  step: every     |
                  query sees them | query i sees node j iff tree_mask[s, i, j]

    e.g. root 0 with children 1, 2 and node 3 a child of 1:      tree_mask[s] (row i = query, col j = key)
              0                                                        j: 0 1 2 3
             / \                                                   i=0:  1 0 0 0
            1   2                                                  i=1:  1 1 0 0
            |                                                      i=2:  1 0 1 0
            3                                                      i=3:  1 1 0 1

tree_mask is bool [S, max_query_len, max_query_len]: a node sees itself and its ancestors (the engine builds it),
so every real row sees the root and its own diagonal; rows and columns at or past query_len[s] are padding and
never read. A chain (each node's parent the one before it) is the ordinary causal step.

KV cache dtype (--kv-cache-dtype): the model dtype, or float8_e4m3fn (one byte an element, twice the tokens in the
same memory). An FP8 cache holds x / k_scale (x / v_scale) rounded to e4m3 (kernels/kv_store.py); every backend
writes it so and multiplies by the scale as it reads. The scales are Python floats fixed when the weights load,
so a captured CUDA graph holds them as constants.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from kestrel.batch import ForwardBatch


class AttentionBackend(ABC):
    name: str = "base"
    compiles_at_first_use: bool = False   # JIT-compiles its kernels on the first forward (startup shows it)

    def prepare(self, batch: ForwardBatch) -> None:
        """Build per-step metadata shared by all layers (called once per forward, before the layers)."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,         # [T, num_heads, head_dim]
        k: torch.Tensor | None,  # [T, num_kv_heads, head_dim]; None: already in the cache
        v: torch.Tensor | None,  # [T, num_kv_heads, head_dim]; None: already in the cache
        k_cache: torch.Tensor,   # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        batch: ForwardBatch,
        scale: float,
        k_scale: float = 1.0,    # an FP8 cache's per-tensor scales (kernels/kv_store.py): cache = x / scale;
        v_scale: float = 1.0,    # ignored for a cache of the model dtype
    ) -> torch.Tensor:           # [T, num_heads, head_dim]
        ...

    # CUDA-graph hooks: a backend that keeps metadata on the device copies it into static buffers here.
    def init_graph_buffers(self, max_batch_size: int, max_blocks_per_seq: int, device: torch.device) -> None:
        """Allocate static metadata buffers shared by every captured graph."""

    def supports_graphs(self) -> bool:
        return False

    def supports_prewritten_kv(self) -> bool:
        """True if forward() accepts k = v = None, the K/V having been written at slot_mapping by the model."""
        return False

    def supports_tree_mask(self) -> bool:
        """True if forward() honours batch.tree_mask (tree verify steps); the engine builds none for others."""
        return False

    def supports_latent_decode(self) -> bool:
        """True if latent_decode runs MLA's absorbed decode on CUDA without host reads (CUDA graphs can hold it)."""
        return False

    def latent_decode(self, q: torch.Tensor, latent_cache: torch.Tensor, batch: ForwardBatch,
                      scale: float, latent_scale: float = 1.0) -> torch.Tensor | None:
        """MLA's absorbed decode (attention/mla.py) as this backend's kernel: q [S, H, kv_lora + rope] over the
        latent cache [num_blocks, block_size, 1, kv_lora + rope] -> [S, H, kv_lora + rope], its first kv_lora
        dims the attention; latent_scale: an FP8 latent cache's. None where the backend has no such kernel for q's device: mla.py's torch road runs."""
        return None
