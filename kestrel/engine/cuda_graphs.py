"""CUDA graphs for steps with a fixed number of query tokens per sequence (decode: 1; verify later: k + 1).

One graph per batch-size bucket (1, 2, 4, 8, then steps of 16 up to --cuda-graph-max-bs), captured largest
first so every graph reuses one shared memory pool. A step with B sequences replays the smallest bucket >= B
after copying its inputs into the static buffers; rows past B are padding:

    static buffers (max_bs rows x query_len tokens):
      input_ids, positions, slot_mapping  [max_bs * query_len]   padding: token 0, position 0, slot -1 (no write)
      kv_lens                             [max_bs]               padding: 1 (attends to one junk slot, ignored)
      block_table                         [max_bs, max_blocks]   padding rows: block 0
"""
from __future__ import annotations

import logging
import time

import torch

from kestrel.config import EngineConfig
from kestrel.engine.batch import ForwardBatch, ForwardOutput
from kestrel.progress import Progress

logger = logging.getLogger("kestrel.cuda_graphs")


def batch_size_buckets(max_bs: int) -> list[int]:
    buckets = [b for b in (1, 2, 4, 8) if b <= max_bs]
    buckets += list(range(16, max_bs + 1, 16))
    if buckets[-1] != max_bs:
        buckets.append(max_bs)
    return buckets


class CudaGraphRunner:
    def __init__(self, runner, max_bs: int, max_blocks_per_seq: int, query_len: int = 1) -> None:
        self.runner = runner
        self.query_len = query_len
        self.max_bs = max_bs
        self.buckets = batch_size_buckets(max_bs)
        device = runner.device
        n = max_bs * query_len
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.kv_lens = torch.ones(max_bs, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(0, n + 1, query_len, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(max_bs, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.logits_at = torch.arange(n, dtype=torch.int64, device=device)
        self.max_kv_len = max_blocks_per_seq * runner.block_size
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None
        self.memory_bytes = 0

    def static_batch(self, bs: int) -> ForwardBatch:
        n = bs * self.query_len
        return ForwardBatch(
            input_ids=self.input_ids[:n], positions=self.positions[:n],
            query_start_loc=self.query_start_loc[: bs + 1], kv_lens=self.kv_lens[:bs],
            block_table=self.block_table[:bs], slot_mapping=self.slot_mapping[:n], logits_at=self.logits_at[:n],
            max_query_len=self.query_len, max_kv_len=self.max_kv_len,
        )

    @torch.inference_mode()
    def capture(self, progress: Progress | None = None) -> None:
        runner = self.runner
        runner.backend.init_graph_buffers(self.max_bs, self.block_table.shape[1], runner.device)
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        for i, bs in enumerate(reversed(self.buckets)):
            batch = self.static_batch(bs)
            for _ in range(2):   # warm up: autotuning and lazy init must happen outside capture
                runner.forward_eager(batch)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = runner.forward_eager(batch).logits
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs] = graph
            self.outputs[bs] = out
            if progress:
                progress.update(i + 1)
        torch.cuda.synchronize()
        self.memory_bytes = max(0, free_before - torch.cuda.mem_get_info()[0])

    def can_run(self, batch: ForwardBatch) -> bool:
        return (batch.max_query_len == self.query_len and batch.num_seqs <= self.max_bs
                and batch.num_tokens == batch.num_seqs * self.query_len and not batch.capture_hidden_layers
                and batch.logits_at.shape[0] == batch.num_tokens)

    def run(self, batch: ForwardBatch) -> ForwardOutput:
        bs = batch.num_seqs
        bucket = next(b for b in self.buckets if b >= bs)
        n = bs * self.query_len
        self.input_ids[:n].copy_(batch.input_ids, non_blocking=True)
        self.positions[:n].copy_(batch.positions, non_blocking=True)
        self.slot_mapping[:n].copy_(batch.slot_mapping, non_blocking=True)
        self.slot_mapping[n: bucket * self.query_len].fill_(-1)
        self.kv_lens[:bs].copy_(batch.kv_lens, non_blocking=True)
        self.kv_lens[bs:bucket].fill_(1)
        width = batch.block_table.shape[1]
        self.block_table[:bs, :width].copy_(batch.block_table, non_blocking=True)
        self.graphs[bucket].replay()
        return ForwardOutput(logits=self.outputs[bucket][:n], hidden_states={})


def capture_decode_graphs(runner, config: EngineConfig, max_model_len: int,
                          progress: Progress) -> CudaGraphRunner | None:
    if not runner.backend.supports_graphs():
        logger.warning("attention backend %s cannot be captured in CUDA graphs; running eagerly",
                       runner.backend.name)
        return None
    max_bs = min(config.cuda_graph_max_bs, config.max_num_seqs)
    graphs = CudaGraphRunner(runner, max_bs, -(-max_model_len // config.block_size))
    progress.begin("capturing_cuda_graphs", len(graphs.buckets), "graphs")
    start = time.monotonic()
    graphs.capture(progress)
    logger.info("captured %d decode graphs (batch sizes %s) in %.1f s, %.2f GiB", len(graphs.buckets),
                graphs.buckets, time.monotonic() - start, graphs.memory_bytes / 2**30)
    return graphs
