"""TritonAttentionBackend: the CUDA fast path (kernels in paged_attention.py, oracle in torch_ref.py)."""
from __future__ import annotations

import torch

from kestrel.kernels.cuda import cluster_decode
from kestrel.kernels.triton import latent_decode, paged_attention, paged_decode
from kestrel.attention.base import AttentionBackend
from kestrel.batch import ForwardBatch


class TritonAttentionBackend(AttentionBackend):
    """Decode steps (one query per sequence) use split-K flash-decoding; anything else the extend kernel.

    Under CUDA graphs the decode kernel must see the same scratch buffers on every replay, so the backend keeps
    one set of split-K partials and split counters sized for the largest captured batch and shared by all layers
    (they run one after another, and each launch leaves the counters at zero for the next). Their head counts and
    head_dim are only known at the first decode forward, so the runner must run one eager decode step (its usual
    warm-up) after init_graph_buffers and before capturing.

    Small bf16 decode batches on Hopper go through cluster_decode.py instead (KESTREL_CLUSTER_DECODE=0 turns it
    off): CUDA C++ whose context splits of one kv head merge inside a thread-block cluster, with no scratch.
    """

    name = "triton"

    def __init__(self) -> None:
        self._max_batch_size = 0
        self._partials: paged_decode.DecodeScratch | None = None

    def supports_graphs(self) -> bool:
        return True

    def supports_prewritten_kv(self) -> bool:
        return True

    def supports_tree_mask(self) -> bool:
        return True

    def init_graph_buffers(self, max_batch_size: int, max_blocks_per_seq: int, device: torch.device) -> None:
        self._max_batch_size = max_batch_size
        self._partials = None   # (re)allocated at the next decode forward, sized for max_batch_size

    def forward(self, q, k, v, k_cache, v_cache, batch: ForwardBatch, scale: float, k_scale: float = 1.0,
                v_scale: float = 1.0) -> torch.Tensor:
        if k is not None:   # None: the fused attention prologue already wrote this step's K/V
            paged_attention.store_kv(k, v, k_cache, v_cache, batch.slot_mapping, k_scale, v_scale)
        if batch.is_decode:   # a tree of one node (no drafts) is its own root: its [S, 1, 1] mask is causal
            assert q.shape[0] == batch.num_seqs, "a decode batch has exactly one query token per sequence"
            num_seqs, num_heads, head_dim = q.shape
            if cluster_decode.usable(q, k_cache, v_cache, num_seqs):   # bf16 caches only; no scratch
                return cluster_decode.decode_attention(q, k_cache, v_cache, batch.block_table, batch.kv_lens, scale)
            partials = self._decode_partials(num_seqs, num_heads, k_cache.shape[2], head_dim, q.device)
            return paged_decode.decode_attention(q, k_cache, v_cache, batch.block_table, batch.kv_lens, scale,
                                                   partials=partials, k_scale=k_scale, v_scale=v_scale)
        return paged_attention.extend_attention(q, k_cache, v_cache, batch.block_table, batch.query_start_loc,
                                               batch.kv_lens, batch.max_query_len, scale, batch.tree_mask,
                                               k_scale, v_scale)

    def supports_latent_decode(self) -> bool:
        return True

    def latent_decode(self, q: torch.Tensor, latent_cache: torch.Tensor, batch: ForwardBatch,
                      scale: float, latent_scale: float = 1.0) -> torch.Tensor | None:
        """The absorbed MLA decode through the split-K kernel (kernels/triton/latent_decode.py), with the same
        graph-static scratch as K/V decode (an MLA model runs no K/V attention, so its layers are the only users).
        On CPU tensors the kernel runs only under Triton's interpreter, which the tests call directly: the engine's
        CPU road stays torch."""
        if q.device.type != "cuda":
            return None
        return self.latent_decode_on_any_device(q, latent_cache, batch, scale, latent_scale)

    def latent_decode_on_any_device(self, q: torch.Tensor, latent_cache: torch.Tensor, batch: ForwardBatch,
                                    scale: float, latent_scale: float = 1.0) -> torch.Tensor:
        assert batch.is_decode and q.shape[0] == batch.num_seqs, "the absorbed decode takes one query a sequence"
        num_seqs, num_heads, width = q.shape
        partials = self._decode_partials(num_seqs, num_heads, latent_decode.head_groups(num_heads), width, q.device)
        return latent_decode.latent_decode_attention(q, latent_cache, batch.block_table, batch.kv_lens, scale,
                                                     partials=partials, latent_scale=latent_scale)

    def _decode_partials(self, num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int,
                         device: torch.device) -> paged_decode.DecodeScratch | None:
        if self._max_batch_size == 0:
            return None   # no graphs: the decode launch allocates scratch per call
        scratch = self._partials
        if (scratch is None or scratch[0].shape[0] < num_seqs or scratch[0].device != device
                or scratch[0].shape[1] != num_heads or scratch[0].shape[3] != head_dim
                or scratch[2].shape[1] != num_kv_heads):
            rows = max(self._max_batch_size, num_seqs)
            self._partials = paged_decode.alloc_decode_partials(rows, num_heads, num_kv_heads, head_dim, device)
        return self._partials
