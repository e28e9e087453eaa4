"""The step loop: schedule -> run -> sample (or verify drafts) -> commit the tokens to their sequences.

The Engine is synchronous and owns the device; whoever calls step() (LLM.generate, or the engine core of
`kestrel serve`, engine/core.py, in its own process) is the only thread touching the model.
"""
from __future__ import annotations

import itertools
import logging
import time
from typing import Callable

import torch

from kestrel.cache.block_pool import BlockPool
from kestrel.cache.radix import NoPrefixCache, PrefixCache, RadixPrefixCache
from kestrel.config import EngineConfig
from kestrel.engine.commit import Committer
from kestrel.engine.messages import EngineLimits, EngineStats, SampleUpdate, TokenLogprob  # noqa: F401
from kestrel.engine.overlap import (PLACEHOLDER, InflightDecode, blocks_to_grow, drop_tokens_from, overlap_eligible,
                                    steps_to_length_stop)
from kestrel.engine.request import Sequence, SeqStatus
from kestrel.engine.sampling_batches import SamplingBatchCache, sampling_batch
from kestrel.engine.scheduler import Scheduler, ScheduledSeq
from kestrel.engine.speculation import SpeculativeDecoding
from kestrel.forward.startup import build_runner
from kestrel.errors import KestrelError
from kestrel.batch import SequenceChunk, build_forward_batch, previous_token
from kestrel.forward.sampler import apply_token_bitmask, sample, top_logprobs
from kestrel.kernels.compile_watch import watch as watch_compiles
from kestrel.models.tokenizer import Tokenizer
from kestrel.progress import Progress
from kestrel.sampling_params import SamplingParams
from kestrel.structured.compiler import GrammarCompiler, tokenizer_info
from kestrel.structured.grammar import validate as validate_structured_output
from kestrel.structured.matcher import SequenceGrammar, plain_bitmask

logger = logging.getLogger("kestrel.engine")


class Engine:
    def __init__(self, config: EngineConfig, progress: Progress | None = None,
                 on_rank_failure: Callable[[str], None] | None = None) -> None:
        """on_rank_failure(message): with tensor parallelism, called (from a watch thread) when a rank dies or
        hangs; without it the failure surfaces as the next step's RankFailure."""
        self.config = config
        self.progress = progress or Progress()
        self.compile_watch = watch_compiles()   # before startup: what it builds is not counted against traffic
        if config.tensor_parallel_size > 1:
            from kestrel.ranks.driver import DriverRunner, Ranks

            ranks = Ranks(config, self.progress, on_rank_failure)
            try:
                setup = build_runner(config, self.progress, ranks.tp)
            except BaseException as exc:
                error = ranks.explain(exc)   # before close(): the watch may still name a dead rank
                ranks.close()
                if error is exc:
                    raise
                raise error from exc
            self.runner = DriverRunner(setup.runner, ranks)
        else:
            setup = build_runner(config, self.progress)
            self.runner = setup.runner
        self.model_config = setup.model_config
        self.tokenizer: Tokenizer = setup.tokenizer
        self.device = setup.runner.device
        self.max_model_len = setup.max_model_len
        self.model_name = config.model_name
        self.pool = BlockPool(setup.num_blocks, config.block_size)
        self.prefix_cache: PrefixCache = (NoPrefixCache() if config.disable_prefix_cache
                                          else RadixPrefixCache(self.pool))
        self.scheduler = Scheduler(self.pool, self.prefix_cache, config.max_num_seqs,
                                   config.max_num_batched_tokens)
        self.requests: dict[str, list[Sequence]] = {}
        # every step's tokens reach their sequences through here (commit.py), with the stop rules
        self.committer = Committer(self.scheduler, self.requests, frozenset(self.tokenizer.eos_token_ids),
                                   self.max_model_len)
        self._seq_ids = itertools.count()
        self._pending: list[SampleUpdate] = []   # finishes decided outside step() (abort, stop strings)
        self.prompt_tokens_total = 0
        self._evictable, self._evictable_at = 0, float("-inf")   # stats(): cached radix-tree count
        # The overlap schedule (engine/overlap.py): at most one decode step launched and not yet read back.
        self._inflight: InflightDecode | None = None
        # the overlap schedule's and the verify steps' sampling settings, kept while the rows stay the same
        self._sampling_batches = SamplingBatchCache(self.runner.device)
        self.spec: SpeculativeDecoding | None = None
        if config.speculative is not None:
            proposer = SpeculativeDecoding.build_proposer(config.speculative, self.runner, config.block_size,
                                                          setup.drafter, setup.drafter_kv,
                                                          setup.drafter_graphs)
            self.spec = SpeculativeDecoding(config.speculative, proposer, scheduler=self.scheduler,
                                            runner=self.runner, committer=self.committer,
                                            sampling_batches=self._sampling_batches,
                                            max_model_len=self.max_model_len, block_size=config.block_size,
                                            vocab_size=self.model_config.vocab_size)
            self.committer.on_forget = self.spec.forget
        self._grammars: GrammarCompiler | None = None   # built at the first structured request
        self.limits = EngineLimits(self.max_model_len, self.model_config.vocab_size,
                                   self.pool.num_blocks * self.pool.block_size)
        self.compile_watch.mark_ready()
        self.progress.ready()

    # ---- requests in -------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if request_id in self.requests:
            raise KestrelError(f"request id {request_id!r} is already in use")
        self.validate_prompt(prompt_token_ids, params)
        compiled = None
        if params.structured_output is not None:   # a bad schema raises here, before anything is queued
            compiled = self.grammar_compiler.compile_async(params.structured_output)
        seqs = []
        for index in range(params.n):
            gen = None
            if params.seed is not None:
                gen = torch.Generator(device=self.device).manual_seed(params.seed + index)
            seqs.append(Sequence(next(self._seq_ids), request_id, index, list(prompt_token_ids), params,
                                 generator=gen, prefill_leader=seqs[0] if seqs else None,
                                 grammar=SequenceGrammar(compiled) if compiled is not None else None))
        self.requests[request_id] = seqs
        self.prompt_tokens_total += len(prompt_token_ids) * params.n
        for seq in seqs:
            self.scheduler.add(seq)

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """The structured-output compiler over this model's vocabulary (the logits' width), made on first use."""
        if self._grammars is None:
            stop = sorted(self.committer.eos_token_ids)
            self._grammars = GrammarCompiler(tokenizer_info(self.tokenizer.hf, self.model_config.vocab_size, stop))
        return self._grammars

    def validate_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise KestrelError for a request that could never run; the server maps it to HTTP 400."""
        self.limits.check_prompt(prompt_token_ids, params)
        if params.structured_output is not None:
            validate_structured_output(params.structured_output)   # a grammar xgrammar cannot build (cached)

    def abort_request(self, request_id: str) -> None:
        for seq in self.requests.get(request_id, []):
            self._finish_outside_step(seq, "abort")

    def finish_sample(self, request_id: str, index: int) -> None:
        """A stop string matched in the sample's text: finish it as "stop"."""
        seqs = self.requests.get(request_id, [])
        if index < len(seqs):
            self._finish_outside_step(seqs[index], "stop")

    def _finish_outside_step(self, seq: Sequence, reason: str) -> None:
        if seq.is_finished:
            return
        inflight = self._inflight
        if inflight is not None and seq in inflight.seqs:   # its launched token is dropped, never reported
            drop_tokens_from(seq, inflight.positions[inflight.seqs.index(seq)])
        self._pending.append(self.committer.finish(seq, reason))

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.committer.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: frozenset[int]) -> None:
        self.committer.eos_token_ids = ids

    # ---- the step ----------------------------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self._pending) or self._inflight is not None

    @torch.inference_mode()
    def step(self) -> list[SampleUpdate]:
        updates = self._step()
        if self.spec is not None:
            self.spec.step_done()
        return updates

    def _step(self) -> list[SampleUpdate]:
        updates, self._pending = self._pending, []
        started = time.perf_counter()
        speculate = self.spec is not None and self.spec.wants_step()
        continuing = not speculate and self._inflight is not None and self._can_continue_overlap(self._inflight)
        if self._inflight is not None and not continuing:
            updates += self._resolve_inflight()
            # a verify step's time starts here: waiting for the overlapped step before it is that step's time
            started = time.perf_counter()
        plan = self.scheduler.schedule()
        if not plan.scheduled:
            return updates + self._resolve_inflight()
        decode = plan.num_tokens == len(plan.scheduled) and all(s.completes_prompt for s in plan.scheduled)
        if speculate and decode:
            return updates + self._verify_step(plan.scheduled, started)
        graph_decode = decode and self.runner.decodes_in_graph(len(plan.scheduled))
        # continuing: _can_continue_overlap already checked these rows are eligible
        if graph_decode and self._overlap_enabled() \
                and (continuing or all(self._overlap_ok(s.seq) for s in plan.scheduled)):
            updates += self._launch_overlapped(plan.scheduled)
            self._record_plain_step(len(plan.scheduled))
            return updates
        if self._inflight is not None:   # defensive: the placeholders must be real tokens before any other step
            updates += self._resolve_inflight()
            plan.scheduled = [s for s in plan.scheduled if not s.seq.is_finished]
            if not plan.scheduled:
                return updates
        output = self.runner.execute(self._chunks(plan.scheduled))
        self._mark_computed(plan.scheduled)
        sampling = [s for s in plan.scheduled if s.completes_prompt]
        if sampling:   # the output's logits rows are exactly these (graph roads: every row completes its prompt)
            updates += self._sample_and_commit(sampling, output.logits, output.tokens)
        if self.spec is not None:
            if decode:
                self._record_plain_step(len(plan.scheduled))
            else:
                self.spec.observe_plain_step(plan.scheduled, output)
        return updates

    def _verify_step(self, rows: list[ScheduledSeq], started: float) -> list[SampleUpdate]:
        """A speculative step (engine/speculation.py): each row's chunk carries its drafts; the verifier keeps the
        accepted run and commits it."""
        proposal = self.spec.propose(rows, started)
        output = self.runner.execute(proposal.chunks)
        return self.spec.verify(proposal, output)

    def _record_plain_step(self, batch_size: int) -> None:
        if self.spec is not None:
            self.spec.record_plain_step(batch_size)

    @staticmethod
    def _chunks(scheduled: list[ScheduledSeq], previous: InflightDecode | None = None) -> list[SequenceChunk]:
        """The step's chunks for the runner; a placeholder token (overlap) becomes a reference to the previous
        launch's output row."""
        chunks = []
        rows = previous.rows if previous is not None else None   # a dict: built once, not per sequence
        for s in scheduled:
            seq = s.seq
            tokens = seq.tokens_at(s.start, s.num_tokens)
            if rows is not None and tokens[-1] == PLACEHOLDER:
                tokens = [previous_token(rows[seq.seq_id])]
            chunks.append(SequenceChunk(seq.seq_id, tokens, s.start, seq.block_ids, seq.num_preemptions,
                                        s.completes_prompt))
        return chunks

    # ---- the overlap schedule (engine/overlap.py) ----------------------------------------------------------
    def _overlap_enabled(self) -> bool:
        return self.runner.graphs is not None and not self.config.disable_overlap_schedule

    def _overlap_ok(self, seq: Sequence) -> bool:
        # A grammar's mask for the next token depends on the token still on the device: it needs the read-back
        # before sampling, which is what the overlap schedule skips.
        if seq.grammar is not None:
            return False
        p = seq.params
        eos = self.committer.eos_token_ids
        return overlap_eligible(seq, bool(p.stop_token_ids) or (not p.ignore_eos and bool(eos)))

    def _can_continue_overlap(self, inflight: InflightDecode) -> bool:
        """Whether the next step is again an eligible graph decode of exactly the launched rows, with blocks to grow
        into and nothing waiting: then it can be launched before `inflight` is read back."""
        running = self.scheduler.running
        if (not self._overlap_enabled() or self.scheduler.waiting or len(running) != len(inflight.seqs)
                or not self.runner.decodes_in_graph(len(running))
                or len(running) > self.config.max_num_batched_tokens):
            return False
        blocks = 0
        for seq in inflight.seqs:
            if seq.status is not SeqStatus.RUNNING or steps_to_length_stop(seq, self.max_model_len) <= 0 \
                    or not self._overlap_ok(seq):
                return False
            blocks += blocks_to_grow(seq, self.config.block_size)
        return blocks <= self.pool.num_free   # never preempt or evict with placeholders in flight

    def _launch_overlapped(self, rows: list[ScheduledSeq]) -> list[SampleUpdate]:
        """Launch this decode step, give each row a placeholder token, then resolve the previous step (which the
        GPU finishes while this one is queued behind it)."""
        seqs = [r.seq for r in rows]
        previous = self._inflight
        output = self.runner.execute(self._chunks(rows, previous))
        tokens = output.tokens
        if not all(seq.params.greedy for seq in seqs):
            # Sampled rows: draw on the device and put the draws where the next launch and the read-back look.
            tokens.copy_(sample(output.logits, self._sampling_batches.get(seqs)))
            self.runner.share_sampled_tokens(tokens)   # other ranks read the next step's tokens from theirs
        host_tokens, done = self.runner.graphs.read_back_async(tokens)
        self._mark_computed(rows)
        positions = []
        for seq in seqs:
            positions.append(len(seq.output_token_ids))
            seq.output_token_ids.append(PLACEHOLDER)
        self._inflight = InflightDecode(seqs, positions, host_tokens, done)
        return self._resolve(previous) if previous is not None else []

    def _resolve_inflight(self) -> list[SampleUpdate]:
        inflight, self._inflight = self._inflight, None
        return self._resolve(inflight) if inflight is not None else []

    def _resolve(self, inflight: InflightDecode) -> list[SampleUpdate]:
        """Commit a launched step's tokens over their placeholders (a stop discards the step launched after it)."""
        tokens = inflight.tokens()
        now = time.monotonic()
        commit = self.committer.commit
        return [commit(seq, [token], None, now, at=pos)
                for seq, pos, token in zip(inflight.seqs, inflight.positions, tokens)
                if not seq.is_finished]   # aborted, or stopped by a string, after the launch

    def _mark_computed(self, scheduled: list[ScheduledSeq]) -> None:
        for s in scheduled:
            s.seq.num_computed_tokens = s.start + s.num_tokens
            if s.completes_prompt and s.seq.num_output_tokens == 0:
                self.scheduler.cache_prompt(s.seq)

    def _sample_and_commit(self, rows: list[ScheduledSeq], logits: torch.Tensor,
                           greedy_tokens: torch.Tensor | None = None) -> list[SampleUpdate]:
        seqs = [r.seq for r in rows]
        params = [s.params for s in seqs]
        wants_logprobs = any(p.logprobs is not None for p in params)
        masked = self.committer.mask_stops_under_min_tokens(seqs, logits)
        # structured outputs: the grammars' masks are filled on the host while the device still runs the step
        masks = plain_bitmask([s.grammar for s in seqs], self.model_config.vocab_size,
                              self._grammars.batch if self._grammars is not None else None)
        if masks is not None:
            apply_token_bitmask(logits, *masks)
            masked = True
        logprob_rows = None
        if greedy_tokens is not None and not masked and not wants_logprobs and all(p.greedy for p in params):
            token_list = greedy_tokens.tolist()   # computed inside the CUDA graph: no more device work
        else:
            max_logprobs = max((p.logprobs or 0) for p in params)
            tokens = sample(logits, sampling_batch(seqs, max_logprobs, logits.device))
            if wants_logprobs:
                chosen, top_vals, top_ids = top_logprobs(logits, tokens, max_logprobs)
                logprob_rows = (chosen.tolist(), top_vals.tolist(), top_ids.tolist())
            token_list = tokens.tolist()   # the one device->host sync of the step
        now = time.monotonic()
        updates = []
        commit = self.committer.commit
        for i, seq in enumerate(seqs):
            token = token_list[i]
            lp = None
            if logprob_rows is not None and seq.params.logprobs is not None:
                k = seq.params.logprobs
                lp = [TokenLogprob(token, logprob_rows[0][i],
                                   list(zip(logprob_rows[2][i][:k], logprob_rows[1][i][:k])))]
            updates.append(commit(seq, [token], lp, now))
        return updates

    @torch.inference_mode()
    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits at every position of one prompt ([T, vocab], float32): scoring and perplexity, like vLLM's
        prompt_logprobs. Runs as its own forward pass on blocks of its own, between steps."""
        self.validate_prompt(token_ids, SamplingParams(max_tokens=1))
        bs = self.config.block_size
        blocks = self.pool.allocate(-(-len(token_ids) // bs))
        try:
            batch = build_forward_batch([list(token_ids)], [0], [blocks], bs)
            batch.logits_at = None   # every position
            return self.runner.forward(batch).logits
        finally:
            self.pool.release(blocks)

    # ---- introspection -----------------------------------------------------------------------------------
    def sequences(self, request_id: str) -> list[Sequence]:
        return list(self.requests.get(request_id, []))

    def stats(self, max_age_s: float = 0.0) -> EngineStats:
        """Counters and KV usage. Blocks held only by the prefix cache are reusable, so they do not count as used;
        counting them walks the radix tree, so a per-step caller passes max_age_s to reuse a recent count."""
        now = time.monotonic()
        if max_age_s <= 0 or now - self._evictable_at > max_age_s:
            self._evictable, self._evictable_at = self.prefix_cache.num_evictable_blocks(), now
        used = max(0, self.pool.num_used - self._evictable)
        pc = self.prefix_cache.stats
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=used / self.pool.num_blocks, num_used_blocks=used,
            num_total_blocks=self.pool.num_blocks, num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.committer.generation_tokens_total,
            prefix_cache_queries=pc.query_tokens, prefix_cache_hits=pc.hit_tokens,
            kernel_builds_after_ready=len(self.compile_watch.after_ready()),
            **self._spec_stats(),
        )

    def _spec_stats(self) -> dict:
        if self.spec is None:
            return {}
        c = self.spec.counters
        return dict(spec_num_drafts=c.num_drafts, spec_num_draft_tokens=c.num_draft_tokens,
                    spec_num_accepted_tokens=c.num_accepted_tokens, spec_accepted_per_pos=tuple(c.accepted_per_pos))
