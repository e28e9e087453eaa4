"""CUDA graphs for single-sequence prefill chunks (the TTFT path), one per padded token-count bucket.

Eager prefill on a slow host is dominated by per-kernel launch cost (a few hundred launches per step), so a
lone request's prompt is run by replaying a graph captured for the next bucket of tokens (16 .. 512). The
padded tail is harmless: its tokens sit after the real ones, so causal attention never lets a real token see
them, and their K/V are not written (slot -1). Packed input buffer (int64), shipped in one copy:

    | input_ids [Q] | positions [Q] | slot_mapping [Q] | kv_len [1] | logits_at [1] | block_table [max_blocks] |
"""
from __future__ import annotations

import logging

import torch

from kestrel.batch import ForwardBatch, ForwardOutput, SequenceChunk

logger = logging.getLogger("kestrel.prefill_graphs")

PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512)


class PrefillGraphs:
    def __init__(self, runner, max_blocks_per_seq: int, max_tokens: int, pool=None) -> None:
        self.runner = runner
        # A padded chunk must fit in one block-table row (max_model_len): bigger buckets are useless anyway.
        capacity = max_blocks_per_seq * runner.block_size
        self.buckets = [q for q in PREFILL_BUCKETS if q <= min(max_tokens, capacity)]
        self.max_q = self.buckets[-1] if self.buckets else 0
        self.max_blocks = max_blocks_per_seq
        q = self.max_q
        self.layout = {"input_ids": (0, q), "positions": (q, q), "slot_mapping": (2 * q, q), "kv_lens": (3 * q, 1),
                       "logits_at": (3 * q + 1, 1), "block_table": (3 * q + 2, max_blocks_per_seq)}
        size = 3 * q + 2 + max_blocks_per_seq
        device = runner.device
        self.host = torch.zeros(size, dtype=torch.int64)
        if device.type == "cuda":
            self.host = self.host.pin_memory()
        self.host_np = self.host.numpy()
        self.dev = torch.zeros(size, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, ForwardOutput] = {}
        self.pool = pool
        self.max_kv_len = max_blocks_per_seq * runner.block_size
        self._qsl = {q: torch.tensor([0, q], dtype=torch.int64, device=device) for q in self.buckets}

    def _view(self, name: str, n: int | None = None) -> torch.Tensor:
        start, size = self.layout[name]
        return self.dev[start:start + (size if n is None else n)]

    def _graph_body(self, q: int) -> ForwardOutput:
        qsl = self._qsl[q]
        batch = ForwardBatch(
            input_ids=self._view("input_ids", q), positions=self._view("positions", q), query_start_loc=qsl,
            kv_lens=self._view("kv_lens"), block_table=self._view("block_table").view(1, -1),
            slot_mapping=self._view("slot_mapping", q), logits_at=self._view("logits_at"),
            max_query_len=q, max_kv_len=self.max_kv_len, capture_hidden_layers=self.runner.capture_hidden_layers,
        )
        out = self.runner.forward(batch)
        out.tokens = out.logits.argmax(dim=-1)
        return out

    @torch.inference_mode()
    def capture(self, dry_run: bool = False) -> None:
        """Record one graph per bucket. dry_run runs each bucket's body on its capture inputs without recording
        (CPU tests check that capture feeds every graph valid inputs)."""
        for q in reversed(self.buckets):
            self.fill_capture_inputs(q)     # each bucket's own inputs: logits_at must index its q rows
            self.dev.copy_(self.host)
            for _ in range(1 if dry_run else 2):
                self._graph_body(q)
            if dry_run:
                continue
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[q] = self._graph_body(q)
            self.pool = self.pool or graph.pool()
            self.graphs[q] = graph
        if not dry_run:
            torch.cuda.synchronize()

    def fill_capture_inputs(self, q: int) -> None:
        """Dummy inputs for capturing bucket q: a q-token prompt whose blocks are all block 0."""
        self._fill([0] * q, 0, [0] * -(-q // self.runner.block_size), q)

    def can_run_chunks(self, chunks: list[SequenceChunk]) -> bool:
        """A lone sequence's chunk of known tokens that fits a bucket."""
        return len(chunks) == 1 and not chunks[0].all_logits and self.can_run(len(chunks[0].tokens), chunks[0].start)

    def can_run(self, num_tokens: int, start: int) -> bool:
        if not 1 < num_tokens <= self.max_q:
            return False
        padded = next(b for b in self.buckets if b >= num_tokens)
        return start + padded <= self.max_kv_len   # padding must stay inside the block table's width

    def _fill(self, tokens: list[int], start: int, blocks: list[int], q: int) -> None:
        h, L, bs = self.host_np, self.layout, self.runner.block_size
        n = len(tokens)
        base = L["input_ids"][0]
        h[base:base + n] = tokens
        h[base + n:base + q] = 0
        base = L["positions"][0]
        h[base:base + n] = range(start, start + n)
        h[base + n:base + q] = 0
        base = L["slot_mapping"][0]
        h[base:base + n] = [blocks[p // bs] * bs + p % bs for p in range(start, start + n)]
        h[base + n:base + q] = -1
        h[L["kv_lens"][0]] = start + q          # padded length: real query i still sits at start + i
        h[L["logits_at"][0]] = n - 1
        base = L["block_table"][0]
        h[base:base + len(blocks)] = blocks

    @torch.inference_mode()
    def run(self, chunk: SequenceChunk) -> ForwardOutput:
        """Replay the graph of the next bucket: logits [1, vocab] and argmax [1] at the chunk's last token, and the
        hidden states of its tokens (padding cut off)."""
        num_tokens = len(chunk.tokens)
        q = next(b for b in self.buckets if b >= num_tokens)
        self._fill(chunk.tokens, chunk.start, chunk.block_ids, q)
        self.dev.copy_(self.host, non_blocking=True)
        if q in self.graphs:
            self.graphs[q].replay()
            out = self.outputs[q]
        else:   # not captured (CPU tests of the padding logic): the same body, eagerly
            out = self._graph_body(q)
        return ForwardOutput(logits=out.logits, tokens=out.tokens,
                             hidden_states={layer: h[:num_tokens] for layer, h in out.hidden_states.items()})
