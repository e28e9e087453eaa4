"""ModelRunner: owns the model, the paged KV cache and the attention backend; runs one step.

`execute(chunks)` is the engine's one entry: it takes the road the step's shape allows and every road builds a
ForwardBatch and runs `forward` on it (inside a captured graph or not), so each returns the same ForwardOutput:

    a decode step of at most cuda_graph_max_bs sequences   -> forward/decode_graphs.py (replay)
    a speculative verify step (k + 1 tokens a sequence)     -> forward/decode_graphs.py, query_len k + 1 (replay)
    a lone sequence's prompt chunk of 2 .. 512 tokens       -> forward/prefill_graphs.py (replay)
    anything else                                           -> eager forward

KV cache memory, one pair per layer (views into one allocation), of this rank's KV heads (all of them with one
rank; layers/linear.py says which with several), in kv_dtype (the model dtype, or float8_e4m3fn with
--kv-cache-dtype fp8: one byte an element, so the same memory holds twice the blocks of a 16-bit cache):

    kv_cache: [num_layers, 2, num_blocks, block_size, num_kv_heads_per_rank, head_dim]
    layer l:  k_cache = kv_cache[l, 0], v_cache = kv_cache[l, 1]

Multi-head latent attention (DeepSeek-V3) caches one latent vector a token instead (attention/mla.py draws it):

    kv_cache: [num_layers, 1, num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]
    layer l:  (latent_cache,) = (kv_cache[l, 0],)
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from kestrel.attention.base import AttentionBackend
from kestrel.distributed.comm import SINGLE, TPGroup
from kestrel.batch import ForwardBatch, ForwardOutput, SequenceChunk, chunks_to_batch
from kestrel.layers.linear import kv_heads_per_rank
from kestrel.models.model_config import ModelConfig

logger = logging.getLogger("kestrel.runner")


def kv_layout(cfg: ModelConfig, tp_size: int = 1) -> tuple[int, int, int]:
    """(planes, heads, width) of one token's cache entry in one layer on one rank: K and V planes of the rank's KV
    heads, or MLA's single latent plane of one shared head."""
    if cfg.kv_lora_rank:
        return 1, 1, cfg.kv_lora_rank + cfg.qk_rope_head_dim
    return 2, kv_heads_per_rank(cfg.num_kv_heads, tp_size), cfg.head_dim


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype, tp_size: int = 1) -> int:
    """Bytes of one block on one rank."""
    planes, heads, width = kv_layout(cfg, tp_size)
    return planes * cfg.num_layers * block_size * heads * width * torch.finfo(dtype).bits // 8


class ModelRunner:
    def __init__(self, model: nn.Module, cfg: ModelConfig, backend: AttentionBackend, device: torch.device,
                 dtype: torch.dtype, block_size: int, capture_hidden_layers: tuple[int, ...] = (),
                 tp: TPGroup = SINGLE, kv_dtype: torch.dtype | None = None) -> None:
        self.model = model
        self.tp = tp   # the model's shard: the KV cache holds this rank's KV heads
        self.cfg = cfg
        self.backend = backend
        self.device = device
        self.dtype = dtype
        self.kv_dtype = kv_dtype or dtype   # the KV cache's element type
        self.block_size = block_size
        self.kv_cache: torch.Tensor | None = None
        self.kv_caches: list[tuple[torch.Tensor, ...]] = []   # (k, v) a layer, or (latent,) with MLA
        # layers whose input hidden states every step returns (EAGLE-3's drafter reads three); set before the
        # graphs are captured, since a graph's outputs are fixed at capture
        self.capture_hidden_layers = capture_hidden_layers
        self.graphs = None          # DecodeGraphs (forward/decode_graphs.py), after capture
        self.prefill_graphs = None  # PrefillGraphs (forward/prefill_graphs.py), after capture
        self.verify_graphs = None   # DecodeGraphs of query_len k + 1 (speculative verify steps), after capture

    def allocate_kv_cache(self, num_blocks: int) -> None:
        cfg = self.cfg
        # Zeroed: padded rows and masked positions read slots nobody wrote, and they must hold finite numbers.
        planes, heads, width = kv_layout(cfg, self.tp.size)
        self.kv_cache = torch.zeros(cfg.num_layers, planes, num_blocks, self.block_size, heads, width,
                                    dtype=self.kv_dtype, device=self.device)
        self.kv_caches = [tuple(self.kv_cache[i].unbind(0)) for i in range(cfg.num_layers)]

    def free_kv_cache(self) -> None:
        self.kv_cache = None
        self.kv_caches = []

    def share_sampled_tokens(self, tokens: torch.Tensor) -> None:
        """The engine drew a launched decode step's tokens itself (sampled rows of the overlap schedule): with
        several ranks they go to every rank (ranks/driver.py); with one there is nothing to do."""

    def close(self) -> None:
        """Stop whatever the runner started besides its own memory (other ranks: ranks/driver.py)."""

    def decodes_in_graph(self, num_seqs: int) -> bool:
        """Whether a decode step of num_seqs sequences (one query token each) replays a graph."""
        return self.graphs is not None and self.graphs.can_run(num_seqs)

    def replays(self, chunks: list[SequenceChunk]) -> bool:
        """Whether execute(chunks) replays a captured graph (the eager road otherwise)."""
        return any(g is not None and g.can_run_chunks(chunks)
                   for g in (self.graphs, self.verify_graphs, self.prefill_graphs))

    @torch.inference_mode()
    def execute(self, chunks: list[SequenceChunk]) -> ForwardOutput:
        """One step of the engine, on the road its shape allows. A decode-graph launch is queued, not waited for:
        its tokens are read when the caller reads them (the overlap schedule reads them one step later)."""
        if self.graphs is not None and self.graphs.can_run_chunks(chunks):
            return self.graphs.launch(chunks)
        if self.verify_graphs is not None and self.verify_graphs.can_run_chunks(chunks):
            return self.verify_graphs.launch(chunks)
        if self.prefill_graphs is not None and self.prefill_graphs.can_run_chunks(chunks):
            return self.prefill_graphs.run(chunks[0])
        return self.forward(chunks_to_batch(chunks, self.block_size, self.capture_hidden_layers))

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, float_logits: bool = True) -> ForwardOutput:
        """Run one ForwardBatch (moved to the device if it lives on the CPU). float_logits=False leaves the logits
        in the model dtype (for a caller that casts them itself)."""
        if batch.input_ids.device != self.device:
            batch = batch.to(self.device)
        self.backend.prepare(batch)
        hidden, captured = self.model(batch, self.backend, self.kv_caches)
        return ForwardOutput(logits=self.model.compute_logits(hidden, float_logits), hidden_states=captured)
