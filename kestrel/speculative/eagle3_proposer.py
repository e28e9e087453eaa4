"""EAGLE-3 drafting: a one-layer drafter that reads three of the target's hidden states and predicts tokens.
DeepSeek's multi-token-prediction layer (models/deepseek_mtp.py) drafts the same way: it reads one target state
(the final one) and has the same interface, so this proposer drives it too (method deepseek_mtp).

The drafter keeps a one-layer KV cache in the target's blocks (same block tables, same slots). Its row at
position p reads the target's hidden states entering the aux layers at p and the token at p + 1, and predicts
the token at p + 2:

    target step computed positions p .. p + n   (a verify step: the last token and n accepted drafts)
    drafter extend:  rows p .. p + n   in: (aux hidden_p', token_{p'+1})   -> KV at p .. p + n
                     last row predicts d1 (the token after the target's bonus token at p + n + 1)
    draft steps:     row p + n + 1     in: (drafter's own hidden of the row before, d1) -> d2
                     row p + n + 2     in: (..., d2) -> d3 ...     (their KV is rewritten by the next extend)

So after every target step the drafter catches up on what the target computed and drafts the next verify step's
tokens at once; a sequence that ran plain decode steps (speculation off) has gaps in the drafter's cache, which
can only lower acceptance, never change the output.
"""
from __future__ import annotations

import torch

from kestrel.attention.base import AttentionBackend
from kestrel.batch import ForwardOutput, SequenceChunk, build_forward_batch
from kestrel.forward.drafter_graphs import DrafterGraphs, top_candidates
from kestrel.batch import ComputedRows
from kestrel.speculative.proposer import DraftSource, Proposer


class Eagle3Proposer(Proposer):
    def __init__(self, drafter, backend: AttentionBackend, kv_cache: torch.Tensor, block_size: int,
                 device: torch.device, graphs: DrafterGraphs | None = None, topk: int = 1) -> None:
        self.drafter = drafter
        self.aux_layers = tuple(drafter.config.aux_layer_ids)
        self.backend = backend   # its own instance (see capture_drafter_graphs): never the target's
        self.graphs = graphs     # after a verify-graph step: extend and drafts in one replay
        # the drafter's one-layer cache planes: (k, v) of [num_blocks, block_size, kv_heads, head_dim], or an
        # MTP drafter's latent plane on a latent-attention target (models/deepseek_mtp.py)
        self.kv = tuple(kv_cache.unbind(0))
        self.block_size = block_size
        self.device = device
        self.topk = topk         # candidates kept per drafting step (a tree: forward/draft_tree.py)
        # seq_id -> (num_tokens they follow, each drafting step's top-k tokens, the chain's first)
        self.pending: dict[int, tuple[int, list[list[int]]]] = {}

    def drafts(self, seq: DraftSource, k: int) -> list[int]:
        steps = self.candidates(seq)
        return [] if steps is None else [step[0] for step in steps[:k]]

    def candidates(self, seq: DraftSource) -> list[list[int]] | None:
        ready = self.pending.get(seq.seq_id)
        if ready is None or ready[0] != seq.num_tokens:   # stale: the sequence moved on without the drafter
            return None
        return ready[1]

    def forget(self, seq_id: int) -> None:
        self.pending.pop(seq_id, None)

    def verify_greedy_and_draft(self, chunks: list[SequenceChunk], drafts: list[list[int]], output: ForwardOutput
                                ) -> list[tuple[int, list[int], list[list[int]]]] | None:
        if self.graphs is None or not self.graphs.can_run_chain(chunks, output):
            return None
        return self.graphs.run_chain(chunks, drafts, output)

    def keep_drafts(self, seq_id: int, num_tokens: int, steps: list[list[int]]) -> None:
        if steps:
            self.pending[seq_id] = (num_tokens, steps)
        else:
            self.pending.pop(seq_id, None)

    @torch.inference_mode()
    def observe(self, rows: list[ComputedRows], output: ForwardOutput) -> None:
        if not rows:
            return
        if self.graphs is not None and self.graphs.can_run(rows, output):
            for r, steps in zip(rows, self.graphs.run(rows, output)):
                if r.draft > 0:
                    self.pending[r.seq_id] = (r.start + r.count + 1, steps[:r.draft])
            return
        aux = torch.cat([output.hidden_states[layer] for layer in self.aux_layers], dim=-1)
        index = torch.tensor([i for r in rows for i in r.rows()], dtype=torch.int64)
        batch = build_forward_batch([r.next_tokens for r in rows], [r.start for r in rows],
                                    [r.block_ids for r in rows], self.block_size).to(self.device)
        self.backend.prepare(batch)
        hidden = self.drafter.from_target(aux.index_select(0, index.to(aux.device)))
        normed, recurrent = self.drafter(batch, hidden, self.backend, self.kv)
        drafting = [i for i, r in enumerate(rows) if r.draft > 0]
        if not drafting:
            return
        # the extend's last row of each drafting sequence predicts its first draft
        ends = torch.tensor(batch.query_start_loc[1:].tolist(), dtype=torch.int64) - 1
        pick = torch.tensor(drafting, dtype=torch.int64, device=normed.device)
        token, candidates = top_candidates(self.drafter, normed.index_select(0, pick), self.topk)
        hidden = recurrent.index_select(0, ends.to(recurrent.device).index_select(0, pick))
        drafted = [candidates]
        depth = max(rows[i].draft for i in drafting)
        positions = [rows[i].start + rows[i].count for i in drafting]   # each draft step's row position
        for _ in range(depth - 1):
            step = build_forward_batch([[0]] * len(drafting), positions, [rows[i].block_ids for i in drafting],
                                       self.block_size).to(self.device)
            step.input_ids = token   # on the device: no read-back between draft steps
            self.backend.prepare(step)
            normed, hidden = self.drafter(step, hidden, self.backend, self.kv)
            token, candidates = top_candidates(self.drafter, normed, self.topk)
            drafted.append(candidates)
            positions = [p + 1 for p in positions]
        table = torch.stack(drafted, dim=1).tolist()   # the one read-back: [sequences, depth, topk]
        for i, steps in zip(drafting, table):
            r = rows[i]
            # drafts follow the sequence once its token after the last computed position is its last token
            self.pending[r.seq_id] = (r.start + r.count + 1, steps[:r.draft])
