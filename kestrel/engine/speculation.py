"""Speculative decoding in the step loop: draft, verify k + 1 tokens a sequence in one target step, keep the
accepted run.

A verify step of sequence s (its last token x at position p, drafts d1 .. dk):

    query tokens   x    d1   d2  ...  dk        positions p .. p + k, K/V written at all of them
    target logits  l0   l1   l2  ...  lk        l_j: the target's distribution after d_j (after x for j = 0)
    verification   accept d1 while it passes against l0, d2 against l1, ...; at the first rejection (or after
                   dk) one token comes from the target itself: n accepted drafts -> n + 1 new tokens
    afterwards     K/V of x, d1 .. dn stay (num_computed_tokens = p + n + 1 = num_tokens - 1); the slots of the
                   rejected drafts are simply rewritten by later steps (the blocks stay with the sequence)

Verification is lossless (speculative/verify.py): greedy output is token-identical to decoding without
speculation and sampled output has the target's distribution. A greedy chain step on the graph roads is verified
by the proposer inside its drafting launch (Proposer.verify_greedy_and_draft): no eager op and one read-back a
step, which is what a small target's 0.5 ms step can afford; other steps verify here, then call observe.
The depth of each step, and whether a sequence drafts at all, comes from speculative/adaptive.py's measured
goodput, so a step that would not pay decodes plainly (and may use the overlap schedule).

The engine runs the step: propose() gives the chunks, the engine executes them, verify() keeps each sequence's
accepted run and hands it to the engine's Committer (engine/commit.py), as a plain step hands its sample.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kestrel.engine.commit import Committer
from kestrel.engine.messages import SampleUpdate, TokenLogprob
from kestrel.engine.request import Sequence
from kestrel.engine.sampling_batches import SamplingBatchCache
from kestrel.engine.scheduler import Scheduler, ScheduledSeq
from kestrel.batch import ForwardOutput, SequenceChunk
from kestrel.forward.sampler import apply_token_bitmask, top_logprobs
from kestrel.speculative.adaptive import DepthPolicy
from kestrel.speculative_config import SpeculativeConfig
from kestrel.speculative.ngram import NgramProposer
from kestrel.batch import ComputedRows
from kestrel.speculative.proposer import Proposer
from kestrel.forward.draft_tree import draft_tree
from kestrel.speculative.verify import verify_chain, verify_tree
from kestrel.structured.matcher import allocate_bitmask

if TYPE_CHECKING:
    from kestrel.forward.runner import ModelRunner

logger = logging.getLogger("kestrel.speculative")


@dataclass
class SpecCounters:
    """Cumulative, as vLLM's spec_decode metrics: a draft is one sequence's drafts of one verify step."""
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_pos) < drafted:
            self.accepted_per_pos += [0] * (drafted - len(self.accepted_per_pos))
        for j in range(accepted):
            self.accepted_per_pos[j] += 1


@dataclass(slots=True)
class Proposal:
    """A verify step's chunks (each sequence's last token, then its drafts or tree nodes) and the drafts in them."""
    seqs: list[Sequence]
    chunks: list[SequenceChunk]
    drafts: list[list[int]]   # a chain's drafts, or a tree's node tokens ([]: the sequence does not draft)


class SpeculativeDecoding:
    """The engine's speculative steps: owned by the Engine, which calls wants_step() before scheduling, for a
    step of decodes propose(), runs the chunks and calls verify(), and observe_plain_step() after every other
    step; step_done() ends every step. It reaches the engine only through what it is given: the scheduler (for
    blocks), the runner (verify graphs, the KV cache), the committer and the sampling-batch cache."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer, *, scheduler: Scheduler,
                 runner: ModelRunner, committer: Committer, sampling_batches: SamplingBatchCache,
                 max_model_len: int, block_size: int, vocab_size: int) -> None:
        self.scheduler = scheduler
        self.vocab_size = vocab_size   # the width of a structured output's token bitmask
        self.runner = runner
        self.device = runner.device
        self.committer = committer
        self.sampling_batches = sampling_batches
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.config = config
        self.max_depth = config.num_speculative_tokens
        self.proposer = proposer
        # a tree (topk > 1) has one fixed shape: a step verifies all of it or none of it
        self.tree = draft_tree(self.max_depth, config.topk, config.num_draft_nodes) if config.is_tree else None
        if self.tree is not None:
            self._depths = self.tree.depths
            self._tree_mask = self.tree.mask()
        depths = (0, self.max_depth) if self.tree is not None else None
        self.policy = DepthPolicy(self.max_depth, config.adaptive, depths=depths)
        self.counters = SpecCounters()
        self.synthetic_rate = config.synthetic_acceptance_rate
        self._per_seq: dict[int, int] = {}
        self._depth = 0
        # benchmarks set a dict here to get each verify step's time split (synchronized: slower, so only then)
        self.timing: dict[str, float] | None = None
        self._this_step: tuple[int, int] | None = None   # (batch size, depth) of the step being run, if timed
        self._last_end = None          # the previous step's end: a CUDA event (GPU) or perf_counter seconds
        self._periods: list = []       # (begin event, end event, (batch size, depth)) not yet finished

    @staticmethod
    def build_proposer(config: SpeculativeConfig, runner, block_size: int, drafter, drafter_kv,
                       drafter_graphs=None) -> Proposer:
        if config.method == "ngram":
            return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        from kestrel.speculative.eagle3_proposer import Eagle3Proposer
        # a backend instance of its own: eager draft steps must not resize the target graphs' decode scratch
        return Eagle3Proposer(drafter, type(runner.backend)(), drafter_kv, block_size, runner.device, drafter_graphs,
                              config.topk)

    # ---- which steps speculate -------------------------------------------------------------------------------
    def _room(self, seq: Sequence) -> int:
        """Drafts the sequence may still use: a verify step makes at most depth + 1 tokens."""
        p = seq.params
        room = self.max_model_len - seq.num_tokens
        left = room if p.max_tokens is None else min(room, p.max_tokens - seq.num_output_tokens)
        if self.tree is not None:   # the whole tree or nothing: its nodes take cache slots past its depth
            return self.max_depth if left - 1 >= self.max_depth and room - 1 >= self.tree.size else 0
        return max(0, min(self.max_depth, left - 1))

    def wants_step(self) -> bool:
        """Whether the next step speculates: only decodes are running, nothing waits to be admitted, and the
        policy picks a depth > 0 for this batch."""
        sched = self.scheduler
        if sched.waiting or not sched.running:
            return False
        seqs = sched.running
        # a prompt still being prefilled (a chunk may have stopped one token short of its end: no output yet)
        if any(s.num_computed_tokens != s.num_tokens - 1 or not s.output_token_ids for s in seqs):
            return False
        graphs = self.runner.verify_graphs
        if graphs is not None and len(seqs) > graphs.max_bs:   # past the verify graphs verification is
            return False                                       # compute-bound: it never pays, not worth a try
        self._depth, per_seq = self.policy.choose([s.seq_id for s in seqs], [self._room(s) for s in seqs])
        self._per_seq = {s.seq_id: k for s, k in zip(seqs, per_seq)}
        if self._depth == 0:   # a plain step: each sequence sat it out (so a request that stopped drafting is probed)
            for s in seqs:
                self.policy.record_acceptance(s.seq_id, 0, 0)
        return self._depth > 0

    def record_plain_step(self, batch_size: int) -> None:
        """The engine ran a plain decode step of batch_size sequences (its cost is taken at step_done)."""
        self._this_step = (batch_size, 0)

    def step_done(self) -> None:
        """The end of every engine step. A step's cost is the time from the previous step's end to its own, on
        the GPU's clock where there is one: that counts the host work around the step (scheduling, drafting,
        output processing), which is what a plain step hides under the overlap schedule and a verify step cannot
        (its time inside step() alone would flatter plain steps by the host work overlapped with them)."""
        key, self._this_step = self._this_step, None
        if self.device.type != "cuda":
            now = time.perf_counter()
            if key is not None and self._last_end is not None:
                self.policy.record_step(key[0], key[1], now - self._last_end)
            self._last_end = now
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        if key is not None and self._last_end is not None:
            self._periods.append((self._last_end, end, key))
        self._last_end = end
        while self._periods and self._periods[0][1].query():   # settle the ones the GPU has finished
            begin, finish, (batch_size, depth) = self._periods.pop(0)
            self.policy.record_step(batch_size, depth, begin.elapsed_time(finish) / 1e3)

    # ---- the verify step -------------------------------------------------------------------------------------
    def propose(self, rows: list[ScheduledSeq], started: float) -> Proposal:
        """The step's chunks: each sequence's last token and the drafts it is to verify (blocks grown for them)."""
        seqs = [r.seq for r in rows]
        wanted = [min(self._per_seq.get(seq.seq_id, 0), self._room(seq)) for seq in seqs]
        if self.synthetic_rate is not None:   # the benchmark mode accepts drafts blindly: never past a grammar
            wanted = [0 if seq.grammar is not None else k for seq, k in zip(seqs, wanted)]
        if self.tree is None:
            chunks, drafts = self._chain_chunks(seqs, wanted)
        else:
            chunks, drafts = self._tree_chunks(seqs, wanted)
        self._lap("propose", started)
        return Proposal(seqs, chunks, drafts)

    def verify(self, proposal: Proposal, output: ForwardOutput) -> list[SampleUpdate]:
        """Verify the proposal's drafts against the target's `output`, commit each sequence's accepted run and the
        target's token after it, and let the proposer follow."""
        seqs, chunks, drafts = proposal.seqs, proposal.chunks, proposal.drafts
        if self._fusable(seqs):
            self._lap("verify")   # timed: the verify forward; the fused verification counts as drafting
            fused = self.proposer.verify_greedy_and_draft(chunks, drafts, output)
            if fused is not None:
                return self._commit_fused(seqs, drafts, fused)
        q = max(len(c.tokens) for c in chunks)
        offsets, logits = _uniform_rows(output.logits, [len(c.tokens) for c in chunks], q)   # row b * q + j
        if any(seq.grammar is not None for seq in seqs):
            self._mask_grammars(logits, seqs, drafts, q)
        # row b * q + j draws output token num_output + depth of query j (a chain: j)
        self.committer.mask_stops_under_min_tokens(seqs, logits, range(q) if self.tree is None else self._depths[:q])
        max_logprobs = max((seq.params.logprobs or 0) for seq in seqs)
        sampling = self.sampling_batches.get(seqs, max_logprobs)
        if self.tree is None:
            accepted, out, paths = self._verify_chain(logits, drafts, q, sampling)
        else:
            accepted, out, paths = self._verify_tree(logits, drafts, q, sampling, chunks)
        num_drafts = [len(d) if self.tree is None else (self.max_depth if d else 0) for d in drafts]
        self._lap("verify")
        # paths[b]: the query index (within the sequence's q rows) each kept token was sampled at
        logprob_rows = None
        if max_logprobs:
            idx = torch.tensor([b * q + paths[b][j] for b, n in enumerate(accepted) for j in range(n + 1)],
                               device=logits.device)
            toks = torch.tensor([t for b, n in enumerate(accepted) for t in out[b][:n + 1]], device=logits.device)
            chosen, top_vals, top_ids = top_logprobs(logits.index_select(0, idx), toks, max_logprobs)
            logprob_rows = (chosen.tolist(), top_vals.tolist(), top_ids.tolist())
        updates, computed, at = [], [], 0
        commit = self.committer.commit
        now = time.monotonic()
        for b, seq in enumerate(seqs):
            start = seq.num_computed_tokens
            new = out[b][:accepted[b] + 1]
            lp = None
            if logprob_rows is not None and seq.params.logprobs is not None:
                k = seq.params.logprobs
                lp = [TokenLogprob(new[j], logprob_rows[0][at + j],
                                   list(zip(logprob_rows[2][at + j][:k], logprob_rows[1][at + j][:k])))
                      for j in range(len(new))]
            at += accepted[b] + 1
            self.counters.record(num_drafts[b], accepted[b])
            self.policy.record_acceptance(seq.seq_id, num_drafts[b], accepted[b])
            update = commit(seq, new, lp, now, verified=True)
            if update.finished:
                self.forget(seq.seq_id)
            else:
                # the K/V of the kept tokens sit at start .. start + kept - 1 (a tree's were moved there); the
                # hidden state of each is at its query row
                kept = len(update.new_token_ids)
                hidden = [offsets[b] + paths[b][j] for j in range(kept)]
                computed.append(self._computed_rows(seq, start, kept, offsets[b], hidden))
            updates.append(update)
        self._lap("bookkeeping")
        self.proposer.observe(computed, output)
        self._lap("draft")
        if any(num_drafts):   # a step of no drafts (the drafter catching up) is neither plain nor speculative
            self._this_step = (len(seqs), self.max_depth if self.tree is not None else max(num_drafts))
        return updates

    def _fusable(self, seqs: list[Sequence]) -> bool:
        """Whether the proposer may verify this chain step itself (greedy, on the device, with its drafting): every
        row greedy, without logprobs or a min_tokens ban (those need the logits on the host's terms)."""
        if self.tree is not None or self.synthetic_rate is not None:
            return False
        banned = self.committer.stop_tokens_under_min_tokens
        return all(seq.params.greedy and seq.params.logprobs is None and seq.grammar is None
                   and not (seq.num_output_tokens < seq.params.min_tokens and banned(seq))
                   for seq in seqs)

    def _mask_grammars(self, logits: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]], q: int) -> None:
        """Structured outputs under speculation: mask each constrained sequence's q rows with what its grammar
        allows after the drafts before that row (a chain: d1 .. dj for row j; a tree: the node's path from the
        root). Verification then checks every draft against the masked distribution, so greedy output is the
        token-for-token output of constrained decoding without speculation, and sampled output its distribution;
        a draft the grammar forbids has probability 0 and is rejected. The matcher walks each path and rolls back."""
        constrained = [b for b, seq in enumerate(seqs) if seq.grammar is not None]
        rows = [b * q + j for b in constrained for j in range(q)]
        bitmask = allocate_bitmask(len(rows), self.vocab_size)   # every token allowed: a padding row's mask
        for i, b in enumerate(constrained):
            d = drafts[b]
            mine, paths = [], []
            for j in range(q):
                if self.tree is None:
                    path = d[:j] if j <= len(d) else None        # past the drafts: padding, never read
                elif j == 0:
                    path = []
                else:
                    path = self._tree_path(d, j - 1) if d else None
                if path is not None:
                    mine.append(i * q + j)
                    paths.append(path)
            seqs[b].grammar.fill_along(bitmask, mine, paths)
        apply_token_bitmask(logits, bitmask, rows)

    def _tree_path(self, nodes: list[int], i: int) -> list[int]:
        """The tokens from the root to tree node i, inclusive."""
        path = []
        while i >= 0:
            path.append(nodes[i])
            i = self.tree.parents[i]
        return path[::-1]

    def _commit_fused(self, seqs: list[Sequence], drafts: list[list[int]],
                      fused: list[tuple[int, list[int], list[list[int]]]]) -> list[SampleUpdate]:
        """Commit a step the proposer verified and drafted after (verify_greedy_and_draft)."""
        self._lap("draft")   # verified on the device and drafted in one launch, read back once
        updates = []
        commit = self.committer.commit
        now = time.monotonic()
        for seq, d, (accepted, new, steps) in zip(seqs, drafts, fused):
            self.counters.record(len(d), accepted)
            self.policy.record_acceptance(seq.seq_id, len(d), accepted)
            update = commit(seq, new, None, now, verified=True)
            if update.finished:
                self.forget(seq.seq_id)
            else:
                self.proposer.keep_drafts(seq.seq_id, seq.num_tokens, steps[:self._next_depth(seq)])
            updates.append(update)
        self._lap("bookkeeping")
        if any(drafts):
            self._this_step = (len(seqs), max(len(d) for d in drafts))
        return updates

    def _chain_chunks(self, seqs: list[Sequence], wanted: list[int]) -> tuple[list[SequenceChunk], list[list[int]]]:
        """Each sequence's verify chunk [last token, d1 .. dk], and its drafts."""
        drafts = []
        for seq, k in zip(seqs, wanted):
            d = self.proposer.drafts(seq, k) if k else []
            if self.synthetic_rate is not None and k:
                d = (d + [0] * k)[:k]   # the benchmark mode drafts every position, guessed or not
            if d and not self.scheduler.grow(seq, seq.num_tokens + len(d)):
                d = []
            drafts.append(d)
        width = max(len(d) for d in drafts)
        graphs = self.runner.verify_graphs
        if graphs is not None and 0 < width and len(seqs) <= graphs.max_bs \
                and all(self.scheduler.grow(seq, seq.num_tokens + self.max_depth) for seq in seqs):
            width = self.max_depth   # pad every row to the captured query length (padding is never accepted)
            padded = [d + [0] * (width - len(d)) for d in drafts]
            if self._fusable(seqs):
                for seq in seqs:
                    self._grow_for_drafting(seq)
        else:   # the eager road takes chunks of any length: no padding
            padded = drafts
        chunks = [SequenceChunk(seq.seq_id, [seq.output_token_ids[-1]] + d, seq.num_computed_tokens, seq.block_ids,
                                seq.num_preemptions, True, all_logits=bool(width))
                  for seq, d in zip(seqs, padded)]
        return chunks, drafts

    def _grow_for_drafting(self, seq: Sequence) -> None:
        """Before a step the proposer verifies and drafts after in one launch: the blocks its drafting writes K/V
        into (positions up to num_tokens + 2K - 1 after the step), which the host would otherwise grow only after
        reading the step back. Past the sequence's last possible token nothing it drafts is ever used. Without
        blocks (a full pool) the drafts past them are only guessed worse."""
        p = seq.params
        limit = self.max_model_len
        if p.max_tokens is not None:
            limit = min(limit, seq.num_prompt_tokens + p.max_tokens)
        self.scheduler.grow(seq, min(seq.num_tokens + 2 * self.max_depth, limit))

    def _tree_chunks(self, seqs: list[Sequence], wanted: list[int]) -> tuple[list[SequenceChunk], list[list[int]]]:
        """Each sequence's tree verify chunk [last token, the tree's nodes in BFS order] (forward/draft_tree.py), and
        its node tokens ([] for a sequence that does not draft: its nodes are padding, never accepted)."""
        tree = self.tree
        drafts = []
        for seq, k in zip(seqs, wanted):
            steps = self.proposer.candidates(seq) if k else None
            if self.synthetic_rate is not None and k:
                steps = steps or [[0] * tree.topk] * tree.depth
            nodes = tree.node_tokens(steps) if steps is not None and len(steps) >= tree.depth else []
            if nodes and not self.scheduler.grow(seq, seq.num_tokens + tree.size):
                nodes = []
            drafts.append(nodes)
        full = any(drafts) and all(self.scheduler.grow(seq, seq.num_tokens + tree.size) for seq in seqs)
        chunks = []
        for seq, nodes in zip(seqs, drafts):
            tokens = [seq.output_token_ids[-1]] + ((nodes or [0] * tree.size) if full else nodes)
            n = len(tokens)
            tree_rows = n > 1   # a lone root is an ordinary decode token
            chunks.append(SequenceChunk(seq.seq_id, tokens, seq.num_computed_tokens, seq.block_ids,
                                        seq.num_preemptions, True, all_logits=tree_rows,
                                        depths=self._depths[:n] if tree_rows else None,
                                        tree_mask=self._tree_mask[:n, :n] if tree_rows else None))
        return chunks, drafts

    def _verify_chain(self, logits: torch.Tensor, drafts: list[list[int]], q: int, sampling
                      ) -> tuple[list[int], list[list[int]], list[list[int]]]:
        width = q - 1
        # one copy for the drafts and their counts
        packed = torch.tensor([d + [-1] * (width - len(d)) + [len(d)] for d in drafts],
                              dtype=torch.int64).to(logits.device).view(len(drafts), width + 1)
        accepted_t, out_t = verify_chain(logits, packed[:, :width], packed[:, width], sampling,
                                         synthetic_acceptance_rate=self.synthetic_rate)
        table = torch.cat([accepted_t[:, None], out_t], dim=1).tolist()   # one read-back
        accepted, out = [row[0] for row in table], [row[1:] for row in table]
        return accepted, out, [list(range(n + 1)) for n in accepted]

    def _verify_tree(self, logits: torch.Tensor, drafts: list[list[int]], q: int, sampling,
                     chunks: list[SequenceChunk]) -> tuple[list[int], list[list[int]], list[list[int]]]:
        """Verify every sequence's tree, then move the accepted path's K/V to the cache indices after the root."""
        tree, batch, device = self.tree, len(drafts), logits.device
        if self.synthetic_rate is not None:   # the benchmark mode accepts along the chain's nodes
            chain = [i for i, (d, r) in enumerate(tree.nodes) if r == 0]
            rows = torch.tensor([b * q + j for b in range(batch) for j in [0] + [c + 1 for c in chain]], device=device)
            tokens = torch.tensor([[d[c] if d else -1 for c in chain] for d in drafts], dtype=torch.int64)
            num = torch.tensor([len(chain) if d else 0 for d in drafts], device=device)
            accepted_t, out_t = verify_chain(logits.index_select(0, rows), tokens.to(device), num, sampling,
                                             synthetic_acceptance_rate=self.synthetic_rate)
            nodes_t = torch.tensor(chain, device=device).expand(batch, -1)
            nodes_t = torch.where(torch.arange(len(chain), device=device) < accepted_t[:, None], nodes_t, -1)
        else:
            tokens = torch.tensor([d if d else [-1] * (q - 1) for d in drafts], dtype=torch.int64)
            parents = torch.tensor([tree.parents[:q - 1]] * batch, dtype=torch.int64).view(batch, q - 1)
            accepted_t, out_t, nodes_t = verify_tree(logits, parents.to(device), tokens.to(device), sampling)
        table = torch.cat([accepted_t[:, None], out_t, nodes_t], dim=1).tolist()   # one read-back
        width = out_t.shape[1]
        accepted = [row[0] for row in table]
        out = [row[1:1 + width] for row in table]
        paths = [[0] + [node + 1 for node in row[1 + width:1 + width + row[0]]] for row in table]
        self._move_accepted_kv(chunks, paths)
        return accepted, out, paths

    def _move_accepted_kv(self, chunks: list[SequenceChunk], paths: list[list[int]]) -> None:
        """A tree's accepted node i (cache index start + i) becomes position start + j, j its depth on the path:
        copy its K/V there in every layer. Indices only grow along a path (BFS order), so no copy overwrites a
        source still to be read."""
        block_size = self.block_size
        src, dst = [], []
        for chunk, path in zip(chunks, paths):
            for j, i in enumerate(path):
                if i != j:
                    for index, into in ((chunk.start + i, src), (chunk.start + j, dst)):
                        into.append(chunk.block_ids[index // block_size] * block_size + index % block_size)
        if src:   # the runner moves them in every layer's K and V (MLA: its latent), on every rank
            self.runner.move_kv(src, dst)

    def _lap(self, phase: str, since: float | None = None) -> None:
        """Add the time since the last lap (or `since`) to `phase` in self.timing, when a benchmark asks."""
        if self.timing is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        now = time.perf_counter()
        self.timing[phase] = self.timing.get(phase, 0.0) + now - (since if since is not None else self._last_lap)
        if phase == "draft":
            self.timing["steps"] = self.timing.get("steps", 0) + 1
        self._last_lap = now

    # ---- following the target -------------------------------------------------------------------------------
    def _computed_rows(self, seq: Sequence, start: int, count: int, hidden_offset: int,
                       hidden_rows: list[int] | None = None) -> ComputedRows:
        """What a step computed for the sequence; it drafts for its next verify step if blocks allow."""
        depth = self._next_depth(seq)
        return ComputedRows(seq.seq_id, start, count, seq.tokens_at(start + 1, count), seq.block_ids,
                            hidden_offset, depth, hidden_rows)

    def _next_depth(self, seq: Sequence) -> int:
        """The drafts the sequence drafts for its next verify step: the full depth if it has room and blocks."""
        depth = self.max_depth if self._room(seq) > 0 else 0
        # The drafter writes K/V up to position num_tokens + depth - 2; the next verify step needs the rest.
        if depth and not self.scheduler.grow(seq, seq.num_tokens + depth):
            depth = 0
        return depth

    def observe_plain_step(self, rows: list[ScheduledSeq], output: ForwardOutput) -> None:
        """After a step without speculation: the drafter follows prompt chunks (cheap next to the target's
        prefill, and what makes the first verify step possible); plain decode rows it skips, so a large batch
        decoding plainly costs nothing extra."""
        if not self.proposer.aux_layers:
            return
        computed, offset = [], 0
        for r in rows:
            seq = r.seq
            prompt_chunk = r.num_tokens > 1 or r.start < seq.num_prompt_tokens
            if prompt_chunk and not seq.is_finished:
                if r.completes_prompt:
                    computed.append(self._computed_rows(seq, r.start, r.num_tokens, offset))
                else:
                    computed.append(ComputedRows(seq.seq_id, r.start, r.num_tokens,
                                                 seq.tokens_at(r.start + 1, r.num_tokens), seq.block_ids, offset, 0))
            offset += r.num_tokens
        self.proposer.observe(computed, output)

    def forget(self, seq_id: int) -> None:
        self.policy.forget(seq_id)
        self.proposer.forget(seq_id)



def _uniform_rows(logits: torch.Tensor, lengths: list[int], q: int) -> tuple[list[int], torch.Tensor]:
    """A step's logits rows (every token of each chunk, chunk after chunk) laid out as q rows a sequence: a chunk
    shorter than q repeats its last row (those positions hold no draft and are never read). Also returns where
    each chunk's rows start (its hidden-state rows start there too)."""
    offsets, at = [], 0
    for n in lengths:
        offsets.append(at)
        at += n
    if all(n == q for n in lengths):
        return offsets, logits
    index = [o + min(j, n - 1) for o, n in zip(offsets, lengths) for j in range(q)]
    return offsets, logits.index_select(0, torch.tensor(index, device=logits.device))
