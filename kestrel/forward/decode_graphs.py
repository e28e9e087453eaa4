"""CUDA graphs for decode steps, built so that one step costs three CUDA API calls on the host.

On a slow host every CUDA call (a copy, a launch) costs tens of microseconds, so a decode step is:
one host-to-device copy of a packed input buffer, one graph replay, one device-to-host copy of the tokens.

One graph per batch-size bucket (1, 2, 4, 8, then steps of 16 up to --cuda-graph-max-bs), captured largest
first so all graphs share one memory pool. Rows past the real batch size are padding. A runner captures steps of
a fixed number Q of query tokens per sequence: Q = 1 for decode (the engine's runner); Q = k + 1 for a speculative
verify step (the last token plus k drafts), whose tokens sit at consecutive positions. Either way a launch takes
the step's SequenceChunks, as the eager road does, and the graph body runs the runner's `forward` on a
ForwardBatch of views into the device buffer.

Block tables live on the device across steps ("persistent rows"): each running sequence owns a row of

    tables: [max_rows + 1, max_blocks_per_seq]      the last row is a dummy that padding reads and writes

and a step only ships the blocks appended since the sequence's last graph step, as (row, col, block) triples
that the graph scatters into `tables` before gathering the batch's rows (on CUDA one kernel does the scatter, the
gather, the input tokens and their embeddings: kestrel/kernels/triton/step_inputs.py). The packed input buffer (int64):

    | prev_tokens [B*Q] | input_ids [B*Q] | input_src [B*Q] | positions [B*Q] | slot_mapping [B*Q] |
    | kv_lens [B] | rows [B] | upd_rows [U] | upd_cols [U] | upd_vals [U] |
      token j of row i is entry i * Q + j of the per-token fields
      padding rows: tokens 0, positions 0, slots -1 (no KV write), kv_len Q, row = dummy; padding updates hit the
      dummy row

`prev_tokens` is never copied from the host: the graph writes its argmax there, and the next step's tokens gather
their value through `input_src`, an index into the packed buffer that points either at the token's own
`input_ids` entry (a token the host knows) or at a `prev_tokens` entry (a token the previous step is still
producing: a chunk's query token previous_token(i), batch.py). That lets the engine launch step N+1
before it has read step N's tokens (the overlap schedule), for any Q.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from kestrel.config import EngineConfig
from kestrel.envs import switches
from kestrel.batch import ForwardBatch, ForwardOutput, SequenceChunk
from kestrel.progress import Progress

logger = logging.getLogger("kestrel.decode_graphs")


def batch_size_buckets(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 16 up to max_bs."""
    buckets = [b for b in (1, 2, 4, 8) if b <= max_bs]
    buckets += list(range(16, max_bs + 1, 16))
    if buckets[-1] != max_bs:
        buckets.append(max_bs)
    return buckets


def pack_fields(fields: list[tuple[str, int]]) -> tuple[dict[str, tuple[int, int]], int]:
    """Fields laid end to end in one int64 buffer: name -> (offset, length), and the buffer's size."""
    layout, size = {}, 0
    for name, n in fields:
        layout[name] = (size, n)
        size += n
    return layout, size


def packed_layout(max_bs: int, q: int, max_table_writes: int) -> tuple[dict[str, tuple[int, int]], int]:
    """The packed input buffer's fields (see the module docstring) as name -> (offset, length), and its size."""
    fields = [(name, max_bs * q) for name in ("prev_tokens", "input_ids", "input_src", "positions", "slot_mapping")]
    fields += [("kv_lens", max_bs), ("rows", max_bs)]
    fields += [(name, max_table_writes) for name in ("upd_rows", "upd_cols", "upd_vals")]
    return pack_fields(fields)


def torch_step_inputs(packed: torch.Tensor, layout: dict[str, tuple[int, int]], tables: torch.Tensor,
                      embed: torch.Tensor | None, block_table: torch.Tensor | None, bs: int, q: int,
                      num_table_writes: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The graph's head in torch ops, with kestrel/kernels/triton/step_inputs.py's signature: the new table entries, the batch's
    block-table rows (whole rows, a new tensor: `block_table` and `block_size` are not used), its input tokens
    and their embeddings."""
    def view(name: str, n: int) -> torch.Tensor:
        return packed[layout[name][0]:layout[name][0] + n]

    tables.index_put_((view("upd_rows", num_table_writes), view("upd_cols", num_table_writes)), view("upd_vals", num_table_writes))
    rows = tables.index_select(0, view("rows", bs))
    input_ids = packed.index_select(0, view("input_src", bs * q))
    return rows, input_ids, None if embed is None else torch.nn.functional.embedding(input_ids, embed)


@dataclass(slots=True)
class _RowState:
    row: int
    written: int                 # blocks of the sequence already in its device row
    generation: int              # the sequence's preemption count when the row was written
    last_block: int = -1         # block id at column written - 1, to notice a rollback that regrew


class DecodeGraphs:
    def __init__(self, runner, max_bs: int, max_blocks_per_seq: int, max_rows: int, query_len: int = 1,
                 fused: bool | None = None, tree: tuple[list[int], torch.Tensor] | None = None) -> None:
        self.runner = runner
        self.max_bs = max_bs
        self.query_len = q = query_len
        # A tree verify runner (forward/draft_tree.py): one fixed tree for every sequence, as (each query token's
        # depth: its rotary position is start + depth, its cache index start + i; the [Q, Q] attention mask).
        self.depths = list(range(q)) if tree is None else list(tree[0])
        self.tree_mask = None if tree is None else \
            tree[1].to(runner.device).expand(max_bs, q, q).contiguous()
        self.buckets = batch_size_buckets(max_bs)
        self.max_table_writes = 2 * max_bs
        self.max_rows = max_rows
        self.dummy_row = max_rows
        device = runner.device
        self.tables = torch.zeros(max_rows + 1, max_blocks_per_seq, dtype=torch.int64, device=device)
        self.layout, size = packed_layout(max_bs, q, self.max_table_writes)
        self.host_start = max_bs * q   # the host's part of the buffer starts after prev_tokens
        # Two pinned input buffers and two token buffers, used in turn: the input copy out of one may still be
        # queued behind the GPU's current step when the host fills the next step's inputs, and step k's tokens are
        # read after step k + 1 is launched (the overlap schedule). Launch k uses pair k % 2; at most one launch is
        # ever unread, so when launch k + 2 comes, step k has been read back and both its copies are done.
        pin = device.type == "cuda"   # pinned: the copies are truly async
        self.host_buffers = [torch.zeros(size, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self.token_buffers = [torch.zeros(max_bs * q, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._host_nps = [b.numpy() for b in self.host_buffers]   # made once: .numpy() costs ~10 us a call
        self._turn = 0
        self.host = self.host_buffers[0]
        self.host_np = self._host_nps[0]
        self.dev = torch.zeros(size, dtype=torch.int64, device=device)
        self.query_start_loc = torch.arange(0, max_bs * q + 1, q, dtype=torch.int64, device=device)
        self.max_kv_len = max_blocks_per_seq * runner.block_size
        # On CUDA (unless KESTREL_FUSED_OPS=0) the fp32 cast and argmax of the logits run in one kernel (-1.5% a
        # 0.6B step, -0.9% on the 8B, against torch's two), with static scratch shared by every bucket's graph (the
        # graphs of one runner replay one at a time, in stream order) ...
        if fused is None:   # the fused head and argmax (below): on CUDA unless KESTREL_FUSED_OPS=0
            fused = device.type == "cuda" and switches().fused_ops
        self.argmax_scratch, self._logits_argmax = None, None
        if fused:
            from kestrel.kernels.triton.logits_argmax import alloc_argmax_scratch, logits_argmax   # Triton: CUDA only
            self.argmax_scratch, self._logits_argmax = alloc_argmax_scratch(max_bs * q, device), logits_argmax
        # ... and so does the graph's head (table updates, block-table rows, input tokens, embeddings:
        # kestrel/kernels/triton/step_inputs.py), whose block-table rows go to this static buffer.
        self._head, self.block_table = torch_step_inputs, None
        # With tensor parallelism the embedding table is a vocab shard: the model looks tokens up itself (and
        # all-reduces), so the head gives no embeddings and the fused head (a whole-table lookup) is not used.
        self._embed = runner.model.embed_tokens.weight if runner.tp.size == 1 else None
        if fused and self._embed is not None:
            from kestrel.kernels.triton.step_inputs import step_inputs   # Triton: CUDA only
            self._head = step_inputs
            self.block_table = torch.zeros(max_bs, max_blocks_per_seq, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, ForwardOutput] = {}
        self.logits_buffer: torch.Tensor | None = None   # [max_bs * Q, vocab] float32, shared by every bucket
        self.pool = None
        self.memory_bytes = 0
        self.row_of: dict[int, _RowState] = {}
        self.free_rows = list(range(max_rows - 1, -1, -1))
        for _ in self.host_buffers:
            self._fill_padding(0, max_bs, 0)
            self._next_host_buffer()

    # ---- the step, as the graph sees it -----------------------------------------------------------------
    def _view(self, name: str, n: int | None = None) -> torch.Tensor:
        start, size = self.layout[name]
        return self.dev[start:start + (size if n is None else n)]

    def _graph_body(self, bs: int) -> ForwardOutput:
        n = bs * self.query_len   # query tokens
        block_table, input_ids, embeds = self._head(
            self.dev, self.layout, self.tables, self._embed, self.block_table, bs,
            self.query_len, self.max_table_writes, self.runner.block_size)
        batch = ForwardBatch(
            input_ids=input_ids, positions=self._view("positions", n),
            query_start_loc=self.query_start_loc[: bs + 1], kv_lens=self._view("kv_lens", bs),
            block_table=block_table, slot_mapping=self._view("slot_mapping", n), logits_at=None,
            max_query_len=self.query_len, max_kv_len=self.max_kv_len, input_embeds=embeds,
            capture_hidden_layers=self.runner.capture_hidden_layers,
            tree_mask=None if self.tree_mask is None else self.tree_mask[:bs],
        )
        tokens = self._view("prev_tokens", n)
        if self.argmax_scratch is not None:
            out = self.runner.forward(batch, float_logits=False)
            out.logits = self._logits_argmax(out.logits, tokens, self.argmax_scratch, self._logits_rows(out.logits, n))
        else:
            out = self.runner.forward(batch)
            torch.argmax(out.logits, dim=-1, out=tokens)
            out.logits = self._logits_rows(out.logits, n).copy_(out.logits)
        out.tokens = tokens
        return out

    def _logits_rows(self, logits: torch.Tensor, n: int) -> torch.Tensor:
        """The first n rows of the float32 logits buffer that every bucket's graph writes. A graph's outputs stay
        allocated for as long as the graph lives, so per-bucket logits would cost sum(buckets) x vocab x 4 bytes
        (1.1 GiB at a 128k vocabulary and max bs 256); one shared buffer costs max_bs x Q rows, and is just as
        valid: a launch's logits were only ever good until the next launch (see `launch`)."""
        if self.logits_buffer is None:   # first made by the largest bucket's warm-up, outside any capture
            self.logits_buffer = torch.empty(self.max_bs * self.query_len, logits.shape[-1], dtype=torch.float32,
                                             device=logits.device)
        return self.logits_buffer[:n]

    @torch.inference_mode()
    def capture(self, progress: Progress | None = None) -> None:
        runner = self.runner
        if self.query_len == 1:   # the backend's decode scratch; a verify runner (extend kernels) needs none, and
            # re-initialising would reallocate the scratch that the decode graphs already point at
            runner.backend.init_graph_buffers(self.max_bs, self.tables.shape[1], runner.device)
        self.dev[self.host_start:].copy_(self.host[self.host_start:])
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        for i, bs in enumerate(reversed(self.buckets)):
            for _ in range(2):   # warm up: autotuning and lazy allocations must happen outside capture
                self._graph_body(bs)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[bs] = self._graph_body(bs)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs] = graph
            if progress:
                progress.update(i + 1)
        torch.cuda.synchronize()
        self.memory_bytes = max(0, free_before - torch.cuda.mem_get_info()[0])

    # ---- host side ---------------------------------------------------------------------------------------
    def can_run(self, num_seqs: int) -> bool:
        return num_seqs <= self.max_bs

    def can_run_chunks(self, chunks: list[SequenceChunk]) -> bool:
        """A step this runner replays: at most max_bs sequences of Q query tokens each, every token's logits (a
        verify step's chunks ask for all of them; a decode chunk's one token is its last)."""
        q = self.query_len
        tree = self.tree_mask is not None
        return len(chunks) <= self.max_bs and all(len(c.tokens) == q and c.wants_logits and (q == 1 or c.all_logits)
                                                  and (c.depths is not None) == tree for c in chunks)

    def _next_host_buffer(self) -> None:
        self._turn ^= 1
        self.host = self.host_buffers[self._turn]
        self.host_np = self._host_nps[self._turn]

    def _fill_padding(self, start: int, stop: int, upd_start: int) -> None:
        """Rows start .. stop - 1 become padding (their tokens at start * Q .. stop * Q - 1)."""
        h, L, q = self.host_np, self.layout, self.query_len
        for name, value in (("input_ids", 0), ("positions", 0), ("slot_mapping", -1)):
            base = L[name][0]
            h[base + start * q:base + stop * q] = value
        for name, value in (("kv_lens", q), ("rows", self.dummy_row)):   # kv_len Q: every query sees a key
            base = L[name][0]
            h[base + start:base + stop] = value
        base = L["input_src"][0]
        h[base + start * q:base + stop * q] = range(L["input_ids"][0] + start * q, L["input_ids"][0] + stop * q)
        for name, value in (("upd_rows", self.dummy_row), ("upd_cols", 0), ("upd_vals", 0)):
            base, size = L[name]
            h[base + upd_start:base + size] = value

    def table_row(self, seq_id: int, blocks: list[int], generation: int, batch: list, updates: list) -> int:
        """The sequence's persistent row in `tables`, appending to `updates` the (row, col, block) entries its row
        lacks; `batch`: the step's sequences (objects with a seq_id), whose rows must not be reclaimed."""
        state = self.row_of.get(seq_id)
        if state is None or state.written != len(blocks) or state.generation != generation \
                or blocks[-1] != state.last_block:
            state = self._row_for(seq_id, blocks, generation, batch)
            for col in range(state.written, len(blocks)):
                updates.append((state.row, col, blocks[col]))
            state.written = len(blocks)
            state.last_block = blocks[-1]
        return state.row

    def _row_for(self, seq_id: int, blocks: list[int], generation: int, batch: list) -> _RowState:
        state = self.row_of.get(seq_id)
        if state is not None and (state.generation != generation or state.written > len(blocks)
                                  or (state.written and blocks[state.written - 1] != state.last_block)):
            state.written = 0   # blocks were replaced (preemption) or dropped (rollback): rewrite the row
            state.generation = generation
        if state is None:
            if not self.free_rows:
                self._reclaim_rows({c.seq_id for c in batch})
            state = _RowState(self.free_rows.pop(), 0, generation)
            self.row_of[seq_id] = state
        return state

    def _reclaim_rows(self, live: set[int]) -> None:
        for seq_id in [s for s in self.row_of if s not in live]:
            self.free_rows.append(self.row_of.pop(seq_id).row)

    @torch.inference_mode()
    def launch(self, chunks: list[SequenceChunk]) -> ForwardOutput:
        """Queue one step of Q query tokens per sequence without waiting for it: logits [bs * Q, vocab] and argmax
        tokens [bs * Q] on the device, row-major, valid until the next launch. A query token previous_token(i)
        takes its value from token i of the previous launch's output, on the device."""
        q, bs = self.query_len, len(chunks)
        self._next_host_buffer()
        h, L = self.host_np, self.layout
        ids_at, prev_at = L["input_ids"][0], L["prev_tokens"][0]
        ids = h[ids_at:ids_at + bs * q]
        srcs = []
        i = 0
        for chunk in chunks:
            for token in chunk.tokens:
                if token >= 0:
                    ids[i] = token
                    srcs.append(ids_at + i)
                else:
                    srcs.append(prev_at - 1 - token)
                i += 1
        base = L["input_src"][0]
        h[base:base + bs * q] = srcs
        return self._launch_rows(chunks)

    def _launch_rows(self, chunks: list[SequenceChunk]) -> ForwardOutput:
        """The rest of a launch, its query tokens already in this turn's host buffer: positions, slots, kv_lens,
        block-table rows and updates, padding, one copy, one replay."""
        q, bs = self.query_len, len(chunks)
        bucket = next(b for b in self.buckets if b >= bs)
        h, L, block_size = self.host_np, self.layout, self.runner.block_size
        depths = self.depths
        updates: list[tuple[int, int, int]] = []
        positions, slots, rows, kv_lens = [], [], [], []
        row_of = self.row_of
        for chunk in chunks:
            start = chunk.start
            blocks = chunk.block_ids
            state = row_of.get(chunk.seq_id)
            if state is not None and state.written == len(blocks) and state.generation == chunk.generation \
                    and blocks[-1] == state.last_block:
                row = state.row   # the common case, inline: this loop is on every step's host path
            else:
                row = self.table_row(chunk.seq_id, blocks, chunk.generation, chunks, updates)
            for i, depth in enumerate(depths):
                pos = start + i   # the cache index; the rotary position is start + depth (a chain: the same)
                positions.append(start + depth)
                slots.append(blocks[pos // block_size] * block_size + pos % block_size)
            rows.append(row)
            kv_lens.append(start + q)
        for name, values in (("positions", positions), ("slot_mapping", slots), ("rows", rows),
                             ("kv_lens", kv_lens)):
            base = L[name][0]
            h[base:base + len(values)] = values
        inline = self.pack_table_writes(updates, h, L, self.max_table_writes)
        self._fill_padding(bs, bucket, inline)
        start = self.host_start   # prev_tokens stays: the previous step may still be writing it
        self.dev[start:].copy_(self.host[start:], non_blocking=True)
        if bucket in self.graphs:
            self.graphs[bucket].replay()
            out = self.outputs[bucket]
        else:   # not captured (CPU tests of the persistent-row bookkeeping): run the same body eagerly
            out = self.outputs[bucket] = self._graph_body(bucket)
        n = bs * q
        return ForwardOutput(logits=out.logits[:n], tokens=out.tokens[:n],
                             hidden_states={layer: h[:n] for layer, h in out.hidden_states.items()},
                             replayed=(self, bucket))

    def pack_table_writes(self, updates: list[tuple[int, int, int]], host: "np.ndarray", layout: dict, max_table_writes: int
                     ) -> int:
        """Put the first max_table_writes table updates in a packed host buffer's upd_* fields (a graph scatters them)
        and write any others into `tables` now (e.g. the first decode after a large prefill). Returns how many
        went into the buffer."""
        inline = updates[:max_table_writes]
        if len(updates) > max_table_writes:
            rest = torch.tensor(updates[max_table_writes:], dtype=torch.int64).to(self.tables.device)
            self.tables.index_put_((rest[:, 0], rest[:, 1]), rest[:, 2])
        for name, col in (("upd_rows", 0), ("upd_cols", 1), ("upd_vals", 2)):
            base = layout[name][0]
            host[base:base + len(inline)] = [u[col] for u in inline]
        return len(inline)

    def read_back_async(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Queue the copy of the last launch's tokens into this turn's pinned buffer: (host buffer, event recorded
        after the copy; None on the CPU, where the copy is already done)."""
        buf = self.token_buffers[self._turn]
        buf[: tokens.shape[0]].copy_(tokens, non_blocking=True)
        if tokens.device.type != "cuda":
            return buf, None
        done = torch.cuda.Event()
        done.record()
        return buf, done


def capture_graphs(runner, config: EngineConfig, max_model_len: int, progress: Progress) -> None:
    """Capture decode graphs (every batch-size bucket) and single-sequence prefill graphs into one pool.

    A capture failure is logged and leaves that path eager: slower, never wrong."""
    if not runner.backend.supports_graphs():
        logger.warning("attention backend %s cannot be captured in CUDA graphs; running eagerly",
                       runner.backend.name)
        return
    from kestrel.forward.prefill_graphs import PrefillGraphs

    max_bs = min(config.cuda_graph_max_bs, config.max_num_seqs)
    max_blocks = -(-max_model_len // config.block_size)
    decode = DecodeGraphs(runner, max_bs, max_blocks, config.max_num_seqs)
    prefill = PrefillGraphs(runner, max_blocks, config.max_num_batched_tokens)
    progress.begin("capturing_cuda_graphs", len(decode.buckets) + len(prefill.buckets), "graphs")
    start = time.monotonic()
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info()[0]
    reserved_before = torch.cuda.memory_reserved()
    try:
        decode.capture(progress)
        runner.graphs = decode
    except Exception:  # noqa: BLE001 - any capture failure falls back to eager decode
        logger.exception("decode graph capture failed; decoding eagerly")
        return
    if config.disable_prefill_cuda_graph:
        prefill.buckets = []
    try:
        prefill.pool = decode.pool
        if prefill.buckets:
            prefill.capture()
        runner.prefill_graphs = prefill if prefill.buckets else None
        progress.update(len(decode.buckets) + len(prefill.buckets))
    except Exception:  # noqa: BLE001
        logger.exception("prefill graph capture failed; prefilling eagerly")
        prefill.buckets = []
    torch.cuda.synchronize()
    # The capture warm-ups' eager steps leave freed blocks cached in the allocator's ordinary pool; hand them back
    # so that what stays reserved is what the graphs hold (their shared pool and the static buffers).
    torch.cuda.empty_cache()
    # The graphs' memory is what the caching allocator reserved for them; the device-wide figure also counts what
    # CUDA itself took (cuBLAS workspaces, kernel modules).
    decode.memory_bytes = max(0, torch.cuda.memory_reserved() - reserved_before)
    device_bytes = max(0, free_before - torch.cuda.mem_get_info()[0])
    logger.info("captured %d decode graphs (batch sizes %s) and %d prefill graphs (tokens %s) in %.1f s; "
                "graphs hold %.2f GiB (allocator; %.2f GiB device-wide)", len(decode.buckets), decode.buckets,
                len(prefill.buckets), prefill.buckets, time.monotonic() - start, decode.memory_bytes / 2**30,
                device_bytes / 2**30)


VERIFY_GRAPH_MAX_BS = 64   # past this batch size verification is compute-bound and the policy decodes plainly


def capture_verify_graphs(runner, config: EngineConfig, max_model_len: int, query_len: int,
                          progress: Progress, tree: tuple[list[int], torch.Tensor] | None = None) -> None:
    """Graphs for speculative verify steps (query_len = k + 1 tokens a sequence, or a tree's nodes + 1), in the
    decode graphs' pool. A capture failure leaves verification eager: slower, never wrong."""
    max_bs = min(config.cuda_graph_max_bs, config.max_num_seqs, VERIFY_GRAPH_MAX_BS)
    verify = DecodeGraphs(runner, max_bs, -(-max_model_len // config.block_size), config.max_num_seqs, query_len,
                          tree=tree)
    verify.pool = runner.graphs.pool
    seconds = try_capture(verify, "verify graphs", progress)
    if seconds is None:
        return
    runner.verify_graphs = verify
    logger.info("captured %d verify graphs of %d tokens a sequence (batch sizes %s) in %.1f s", len(verify.buckets),
                query_len, verify.buckets, seconds)


def try_capture(graphs, what: str, progress: Progress) -> float | None:
    """Capture one family of graphs (their `buckets`, their `capture(progress)`) with progress. A failure is
    logged and leaves those steps eager (slower, never wrong): None. Else the seconds it took."""
    progress.begin("capturing_cuda_graphs", len(graphs.buckets), what)
    start = time.monotonic()
    try:
        graphs.capture(progress)
    except Exception:  # noqa: BLE001 - any capture failure falls back to eager steps
        logger.exception("%s: capture failed; those steps run eagerly", what)
        return None
    return time.monotonic() - start
