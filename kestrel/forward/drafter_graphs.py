"""CUDA graphs for the EAGLE-3 drafter after a verify step: its extend and its K - 1 draft steps in one replay.

Eager, the drafter costs a few milliseconds a step on a slow host (dozens of small launches per draft step, each
tens of microseconds); replayed, it costs one copy in, one replay and one read-back. One graph per verify-graph
batch bucket, captured into the decode graphs' pool. Graph b reads the hidden states of verify graph b's static
output directly, so drafter row i is verify row i (a sequence that finished in the verify step is a padding row).

A verify step of sequence i computed positions p .. p + Q - 1 (Q = K + 1) and kept n + 1 of them (count):

    extend      rows p .. p + Q - 1, query tokens = the tokens after each position; rows past count are padding
                (slot -1: no K/V written; their outputs are never read). The row at p + count - 1 predicts d1.
    draft j     one row at p + count + j - 1 (j = 1 .. K - 1), token d_j, the previous row's recurrent hidden;
                predicts d_{j+1}. Its K/V is written where the sequence has blocks (else slot -1: it drafts for
                nothing a verify step will read).

A greedy chain step can leave verification itself to the graph (run_chain): count = n + 1, n the drafts that
equal the verify graph's argmax tokens up to the first that does not, and the extend's tokens are those argmax
tokens. Then the verify step and the drafter need no read-back between them: the host reads the accepted counts,
the new tokens and the next drafts in one copy, and launches no eager op (on a 0.5 ms target each sync and each
launch is a visible share of the step).

The packed input buffer (int64, one host-to-device copy a launch):

    | tokens [B*Q] | positions [B*Q] | slots [B*Q] | hidden_rows [B*Q] | kv_lens [B] | rows [B] | count [B] |
    | covered [B] | num_drafts [B] | drafts [B*(Q-1)] | upd_rows [U] | upd_cols [U] | upd_vals [U] |
      hidden_rows: the verify output row each extend row reads (a tree's accepted path skips nodes; a chain's
      rows are its own); count: the extend's real rows (-1: verify greedily on the device: tokens come from the
      verify graph, slots are given for all Q rows); covered: positions with blocks; drafts, num_drafts: the
      verify chunk's drafts (count -1 only)
      rows: the sequence's block-table row, shared with the verify graphs (their `tables`, their bookkeeping)

Output [B, 1 + Q + K*topk] int64 on the device, read back once: the accepted drafts n (count - 1), the chain's
new tokens (the accepted drafts then the target's token, -1 after; count -1 only), each draft step's top-k
tokens (the chain follows the first).
"""
from __future__ import annotations

import logging

import torch

from kestrel.attention.base import AttentionBackend
from kestrel.batch import ComputedRows, ForwardBatch, ForwardOutput, SequenceChunk
from kestrel.forward.decode_graphs import DecodeGraphs, pack_fields, try_capture
from kestrel.progress import Progress

logger = logging.getLogger("kestrel.speculative")


def top_candidates(drafter, normed: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the drafter's greedy token [B], its top-k tokens [B, topk], greedy first), in the target's vocabulary."""
    logits = drafter.compute_logits(normed)
    if topk == 1:
        token = drafter.draft_to_target(logits.argmax(dim=-1))
        return token, token[:, None]
    candidates = drafter.draft_to_target(logits.topk(topk, dim=-1).indices)
    return candidates[:, 0], candidates


def drafter_layout(max_bs: int, q: int, max_table_writes: int) -> tuple[dict[str, tuple[int, int]], int]:
    """The packed input buffer's fields as name -> (offset, length), and its size."""
    fields = [(name, max_bs * q) for name in ("tokens", "positions", "slots", "hidden_rows")]
    fields += [(name, max_bs) for name in ("kv_lens", "rows", "count", "covered", "num_drafts")]
    fields += [("drafts", max_bs * (q - 1))]
    fields += [(name, max_table_writes) for name in ("upd_rows", "upd_cols", "upd_vals")]
    return pack_fields(fields)


class DrafterGraphs:
    def __init__(self, drafter, backend: AttentionBackend, kv: tuple[torch.Tensor, torch.Tensor],
                 verify: DecodeGraphs, depth: int, topk: int = 1) -> None:
        self.drafter = drafter
        self.backend = backend
        self.kv = kv
        self.verify = verify
        self.q = verify.query_len
        self.depth = depth
        self.topk = topk
        self.aux_layers = tuple(drafter.config.aux_layer_ids)
        self.buckets = verify.buckets
        self.max_bs = verify.max_bs
        self.block_size = verify.runner.block_size
        self.max_table_writes = 2 * self.max_bs
        self.layout, size = drafter_layout(self.max_bs, self.q, self.max_table_writes)
        device = verify.tables.device
        pin = device.type == "cuda"
        self.host = torch.zeros(size, dtype=torch.int64, pin_memory=pin)
        self.host_np = self.host.numpy()
        self.dev = torch.zeros(size, dtype=torch.int64, device=device)
        self.query_start_loc = torch.arange(0, self.max_bs * self.q + 1, self.q, dtype=torch.int64, device=device)
        self.decode_start_loc = torch.arange(0, self.max_bs + 1, dtype=torch.int64, device=device)
        self.query_index = torch.arange(self.q, dtype=torch.int64, device=device)   # j of a row's Q query rows
        self.max_kv_len = verify.max_kv_len
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.memory_bytes = 0
        self._fill_padding(0, self.max_bs, 0)

    # ---- the graph body ------------------------------------------------------------------------------------
    def _view(self, name: str, n: int | None = None) -> torch.Tensor:
        start, size = self.layout[name]
        return self.dev[start:start + (size if n is None else n)]

    def _body(self, bs: int) -> torch.Tensor:
        q, block_size, drafter = self.q, self.block_size, self.drafter
        n = bs * q
        tables = self.verify.tables
        tables.index_put_((self._view("upd_rows"), self._view("upd_cols")), self._view("upd_vals"))
        block_table = tables.index_select(0, self._view("rows", bs))
        verified = self.verify.outputs[bs]
        aux = torch.cat([verified.hidden_states[layer] for layer in self.aux_layers], dim=-1).index_select(
            0, self._view("hidden_rows", n))
        accepted, chain_tokens = self._greedy_chain(verified.tokens, bs)
        host_count = self._view("count", bs)
        by_host = host_count >= 0
        count = torch.where(by_host, host_count, accepted + 1)
        tokens = torch.where(by_host[:, None], self._view("tokens", n).view(bs, q), chain_tokens.clamp(min=0))
        # rows past count are padding: no K/V written, outputs never read
        slots = torch.where(self.query_index < count[:, None], self._view("slots", n).view(bs, q), -1)
        last = self.query_start_loc[:bs] + count - 1   # the extend row at p + count - 1 predicts d1
        extend = ForwardBatch(
            input_ids=tokens.view(n), positions=self._view("positions", n),
            query_start_loc=self.query_start_loc[:bs + 1], kv_lens=self._view("kv_lens", bs),
            block_table=block_table, slot_mapping=slots.view(n), logits_at=last,
            max_query_len=q, max_kv_len=self.max_kv_len)
        self.backend.prepare(extend)
        normed, recurrent = drafter(extend, aux, self.backend, self.kv)
        token, candidates = self._next(normed)
        state = recurrent.index_select(0, last)
        drafted = [candidates]
        pos = self._view("positions", n).view(bs, q)[:, 0] + count   # the first draft step's row: p + count
        covered = self._view("covered", bs)
        max_col = block_table.shape[1] - 1
        for _ in range(self.depth - 1):
            col = torch.clamp(pos // block_size, max=max_col)
            slot = block_table.gather(1, col[:, None]).squeeze(1) * block_size + pos % block_size
            has_block = pos < covered
            step = ForwardBatch(
                input_ids=token, positions=pos, query_start_loc=self.decode_start_loc[:bs + 1],
                # a row past its blocks attends over what it has: never past its block-table row
                kv_lens=torch.minimum(pos + 1, covered.clamp(min=1)), block_table=block_table,
                slot_mapping=torch.where(has_block, slot, -1), logits_at=None, max_query_len=1,
                max_kv_len=self.max_kv_len)
            self.backend.prepare(step)
            normed, state = drafter(step, state, self.backend, self.kv)
            token, candidates = self._next(normed)
            drafted.append(candidates)
            pos = pos + 1
        drafts = torch.stack(drafted, dim=1).view(bs, -1)
        return torch.cat([(count - 1)[:, None], chain_tokens, drafts], dim=1)

    def _greedy_chain(self, target: torch.Tensor, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy verification of each row's chunk [x, d1 .. dk] against the verify graph's argmax tokens target
        [bs * Q] (target[j]: the target's token after query token j): (n [bs]: the drafts up to the first that is
        not the argmax, tokens [bs, Q]: the argmax tokens at j <= n, -1 after). speculative/verify.py's rule for
        deterministic drafts and one-hot p: the accepted drafts are the argmax tokens, and so is the last one."""
        q = self.q
        target = target.view(bs, q)
        drafts = self._view("drafts", bs * (q - 1)).view(bs, q - 1)
        ok = (drafts == target[:, :q - 1]) & (self.query_index[:q - 1] < self._view("num_drafts", bs)[:, None])
        accepted = ok.long().cumprod(dim=1).sum(dim=1)
        return accepted, torch.where(self.query_index <= accepted[:, None], target, -1)

    def _next(self, normed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the drafter's greedy token [B], its top-k tokens [B, topk]), in the target's vocabulary."""
        return top_candidates(self.drafter, normed, self.topk)

    @torch.inference_mode()
    def capture(self, progress: Progress | None = None) -> None:
        self.dev.copy_(self.host)   # padding everywhere: warm-up and capture write no K/V
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        for i, bs in enumerate(reversed(self.buckets)):
            for _ in range(2):   # autotuning and lazy allocations happen outside capture
                self._body(bs)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.verify.pool):
                self.outputs[bs] = self._body(bs)
            self.graphs[bs] = graph
            if progress:
                progress.update(i + 1)
        torch.cuda.synchronize()
        self.memory_bytes = max(0, free_before - torch.cuda.mem_get_info()[0])

    # ---- host side -----------------------------------------------------------------------------------------
    def can_run(self, rows: list[ComputedRows], output: ForwardOutput) -> bool:
        """Whether `output` came from a verify-graph launch whose rows these are."""
        return output.replayed is not None and output.replayed[0] is self.verify \
            and all(r.count <= self.q and r.hidden_offset % self.q == 0 for r in rows)

    def _fill_padding(self, start: int, stop: int, upd_start: int) -> None:
        h, L, q = self.host_np, self.layout, self.q
        for name, value in (("tokens", 0), ("positions", 0), ("slots", -1), ("hidden_rows", 0)):
            base = L[name][0]
            h[base + start * q:base + stop * q] = value
        for name, value in (("kv_lens", q), ("rows", self.verify.dummy_row), ("count", 1), ("covered", 0),
                            ("num_drafts", 0)):
            base = L[name][0]
            h[base + start:base + stop] = value
        for name, value in (("upd_rows", self.verify.dummy_row), ("upd_cols", 0), ("upd_vals", 0)):
            base, size = L[name]
            h[base + upd_start:base + size] = value

    @torch.inference_mode()
    def run(self, rows: list[ComputedRows], output: ForwardOutput) -> list[list[list[int]]]:
        """Extend and draft after the verify step that made `output`: each row's K steps of top-k candidates (in
        `rows` order)."""
        q, block_size, verify = self.q, self.block_size, self.verify
        bucket = output.replayed[1]
        h, L = self.host_np, self.layout
        self._fill_padding(0, bucket, 0)
        updates: list[tuple[int, int, int]] = []
        tok_at, pos_at, slot_at, hid_at = L["tokens"][0], L["positions"][0], L["slots"][0], L["hidden_rows"][0]
        for r in rows:
            b = r.hidden_offset // q
            blocks = r.block_ids
            generation = verify.row_of[r.seq_id].generation   # the verify launch just wrote its row
            row = verify.table_row(r.seq_id, blocks, generation, rows, updates)
            at = b * q
            h[tok_at + at:tok_at + at + r.count] = r.next_tokens
            h[pos_at + at:pos_at + at + q] = range(r.start, r.start + q)
            h[hid_at + at:hid_at + at + r.count] = r.rows()
            h[slot_at + at:slot_at + at + r.count] = [
                blocks[p // block_size] * block_size + p % block_size for p in range(r.start, r.start + r.count)]
            for name, value in (("kv_lens", r.start + q), ("rows", row), ("count", r.count),
                                ("covered", len(blocks) * block_size)):
                h[L[name][0] + b] = value
        table = self._launch(bucket, updates)
        return [self._steps(table[r.hidden_offset // q]) for r in rows]

    def can_run_chain(self, chunks: list[SequenceChunk], output: ForwardOutput) -> bool:
        """Whether run_chain can verify and draft after `output`: a chain verify-graph launch of these chunks."""
        return output.replayed is not None and output.replayed[0] is self.verify and self.verify.tree_mask is None \
            and all(len(c.tokens) == self.q for c in chunks)

    @torch.inference_mode()
    def run_chain(self, chunks: list[SequenceChunk], drafts: list[list[int]], output: ForwardOutput
                  ) -> list[tuple[int, list[int], list[list[int]]]]:
        """Verify the greedy chain step that made `output` (chunk b: [x, drafts[b], padding]) and draft after it, in
        one launch and one read-back: each chunk's (accepted drafts n, the n + 1 new tokens, K steps of top-k
        candidates drafted after them). Every real row drafts; the caller keeps what it may use."""
        q, block_size, verify = self.q, self.block_size, self.verify
        bucket = output.replayed[1]
        h, L = self.host_np, self.layout
        self._fill_padding(0, bucket, 0)
        updates: list[tuple[int, int, int]] = []
        pos_at, slot_at, hid_at, drafts_at = L["positions"][0], L["slots"][0], L["hidden_rows"][0], L["drafts"][0]
        for b, (chunk, d) in enumerate(zip(chunks, drafts)):
            blocks, start, at = chunk.block_ids, chunk.start, b * q
            row = verify.table_row(chunk.seq_id, blocks, chunk.generation, chunks, updates)
            h[pos_at + at:pos_at + at + q] = range(start, start + q)
            h[hid_at + at:hid_at + at + q] = range(at, at + q)
            # every query row's slot (the verify chunk's blocks hold them); the graph keeps the first count
            h[slot_at + at:slot_at + at + q] = [blocks[p // block_size] * block_size + p % block_size
                                                for p in range(start, start + q)]
            h[drafts_at + b * (q - 1):drafts_at + b * (q - 1) + len(d)] = d
            for name, value in (("kv_lens", start + q), ("rows", row), ("count", -1),
                                ("covered", len(blocks) * block_size), ("num_drafts", len(d))):
                h[L[name][0] + b] = value
        table = self._launch(bucket, updates)
        out = []
        for row in table[:len(chunks)]:
            n = row[0]
            out.append((n, row[1:n + 2], self._steps(row)))
        return out

    def _launch(self, bucket: int, updates: list[tuple[int, int, int]]) -> list[list[int]]:
        """One copy in, one replay (eager on the CPU), the one read-back: the output table's rows."""
        inline = self.verify.pack_table_writes(updates, self.host_np, self.layout, self.max_table_writes)
        self._fill_padding(bucket, bucket, inline)
        self.dev.copy_(self.host, non_blocking=True)
        if bucket in self.graphs:
            self.graphs[bucket].replay()
            table = self.outputs[bucket]
        else:   # not captured (CPU): the same body, eagerly
            table = self._body(bucket)
        return table.tolist()

    def _steps(self, row: list[int]) -> list[list[int]]:
        """An output row's K draft steps of top-k tokens."""
        at, topk = 1 + self.q, self.topk
        return [row[at + j * topk:at + (j + 1) * topk] for j in range(self.depth)]


def capture_drafter_graphs(drafter, kv: tuple[torch.Tensor, torch.Tensor], runner, depth: int, topk: int,
                           progress: Progress) -> DrafterGraphs | None:
    """Graphs for the drafter after verify steps, one per verify-graph bucket, in the same pool. A capture failure
    leaves drafting eager: slower, never wrong."""
    # Its own backend instance: the drafter's heads may differ from the target's, and a shared backend would
    # reallocate the decode scratch that the target's graphs point at.
    backend = type(runner.backend)()
    graphs = DrafterGraphs(drafter, backend, kv, runner.verify_graphs, depth, topk)
    backend.init_graph_buffers(graphs.max_bs, runner.verify_graphs.tables.shape[1], runner.device)
    seconds = try_capture(graphs, "drafter graphs", progress)
    if seconds is None:
        return None
    logger.info("captured %d drafter graphs (%d steps, top-%d, batch sizes %s) in %.1f s, %.2f GiB",
                len(graphs.buckets), depth, topk, graphs.buckets, seconds, graphs.memory_bytes / 2**30)
    return graphs
