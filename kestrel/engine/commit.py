"""Committing tokens to a sequence: the one way a step's tokens become output, whichever step made them (a plain
step's sample, an overlapped step's tokens read back over their placeholders, a verify step's accepted run).

Committer.commit appends the tokens up to the first stop, counts them, stamps the first token's time, finishes a
stopped sequence through the scheduler (its blocks go back, its full blocks to the prefix cache), forgets a request
whose samples have all finished, and returns the SampleUpdate the step reports. The stop rules live beside it:
what ends a sequence after a token, and which tokens min_tokens forbids before that.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch

from kestrel.engine.messages import SampleUpdate, TokenLogprob
from kestrel.engine.overlap import drop_tokens_from
from kestrel.engine.request import Sequence
from kestrel.engine.scheduler import Scheduler

logger = logging.getLogger("kestrel.engine")


class Committer:
    def __init__(self, scheduler: Scheduler, requests: dict[str, list[Sequence]], eos_token_ids: frozenset[int],
                 max_model_len: int) -> None:
        self.scheduler = scheduler
        self.requests = requests   # the engine's table (shared): a request leaves it once every sample finished
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.generation_tokens_total = 0
        # called with each sample's seq id as its request is forgotten (speculation drops its drafting state)
        self.on_forget: Callable[[int], None] | None = None

    # ---- committing ------------------------------------------------------------------------------------------
    def commit(self, seq: Sequence, tokens: list[int], logprobs: list[TokenLogprob] | None, now: float, *,
               at: int | None = None, verified: bool = False) -> SampleUpdate:
        """Give `seq` the step's new `tokens` up to and including the first that stops it; `logprobs` (one a token,
        or None) are reported for the kept ones. `now`: the step's time.monotonic(), the first token's stamp.

        at: where the tokens go in output_token_ids, over placeholders of the overlap schedule (None: appended);
            any placeholder after them belongs to a step launched later, which a stop here discards.
        verified: a verify step's tokens. Its chunk computed the K/V of the sequence's last token and of every
            accepted draft, so the computed tokens advance with the kept ones (before a finish caches them); a
            plain step marked its chunk computed before sampling.
        """
        out = seq.output_token_ids
        at = len(out) if at is None else at
        kept, reason = 0, None
        for token in tokens:
            if at + kept < len(out):
                out[at + kept] = token
            else:
                out.append(token)
            kept += 1
            reason = self.stop_reason(seq, token, num_out=at + kept)
            if seq.grammar is not None:
                reason = self._advance_grammar(seq, token) or reason
            if reason is not None:
                break
        self.generation_tokens_total += kept
        if seq.first_token_time is None:
            seq.first_token_time = now
        if verified:
            seq.num_computed_tokens += kept
        if reason is not None:
            if at + kept < len(out):
                drop_tokens_from(seq, at + kept)
            self.scheduler.finish(seq, reason)
        reported = self.report(seq, tokens[:kept], None if logprobs is None else logprobs[:kept])
        if reason is not None:
            self._forget_request_when_done(seq.request_id)
        return reported

    @staticmethod
    def _advance_grammar(seq: Sequence, token: int) -> str | None:
        """Move the sequence's grammar past a committed token: "stop" once the grammar has ended (its stop token
        accepted, as with ignore_eos, where the EOS itself would not stop). Every token was sampled under the
        grammar's mask, so a refusal is a bug: the sequence stops rather than leave the grammar."""
        if not seq.grammar.accept(token):
            logger.error("request %s: token %d is outside its grammar; finishing it", seq.request_id, token)
            return "stop"
        return "stop" if seq.grammar.is_terminated else None

    def finish(self, seq: Sequence, reason: str) -> SampleUpdate:
        """Finish a sequence between steps (an abort, a stop string in its text): no new tokens."""
        self.scheduler.finish(seq, reason)
        reported = self.report(seq, [], None)
        self._forget_request_when_done(seq.request_id)
        return reported

    @staticmethod
    def report(seq: Sequence, tokens: list[int], logprobs: list[TokenLogprob] | None) -> SampleUpdate:
        return SampleUpdate(seq.request_id, seq.index, tokens, logprobs, seq.is_finished, seq.finish_reason,
                            seq.num_prompt_tokens, seq.num_cached_tokens)

    def _forget_request_when_done(self, request_id: str) -> None:
        seqs = self.requests.get(request_id)
        if seqs is not None and all(s.is_finished for s in seqs):
            del self.requests[request_id]
            if self.on_forget is not None:
                for seq in seqs:
                    self.on_forget(seq.seq_id)

    # ---- the stop rules --------------------------------------------------------------------------------------
    def stop_reason(self, seq: Sequence, token: int, num_out: int) -> str | None:
        """Why the sequence stops after `token`, its num_out-th output token (None: it goes on)."""
        p = seq.params
        if num_out >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                return "stop"
            if token in p.stop_token_ids:
                return "stop"
        if p.max_tokens is not None and num_out >= p.max_tokens:
            return "length"
        if num_out + len(seq.prompt_token_ids) >= self.max_model_len:
            return "length"
        return None

    def stop_tokens_under_min_tokens(self, seq: Sequence) -> list[int]:
        """The tokens a sample may not draw while it has fewer than min_tokens outputs (none without min_tokens)."""
        p = seq.params
        if not p.min_tokens or seq.grammar is not None:   # a grammar decides where its output may end
            return []
        return list(p.stop_token_ids) + ([] if p.ignore_eos else list(self.eos_token_ids))

    def mask_stops_under_min_tokens(self, seqs: list[Sequence], logits: torch.Tensor,
                                    depths: list[int] | range = range(1)) -> bool:
        """Forbid the stop tokens where a sample is still under min_tokens: sequence b's rows are
        b * len(depths) + j, row j drawing its output token num_output_tokens + depths[j] (a plain step: one row
        at depth 0). Returns whether anything was masked."""
        q, masked = len(depths), False
        for b, seq in enumerate(seqs):
            banned = self.stop_tokens_under_min_tokens(seq)
            if not banned:
                continue
            for j in range(q):
                if seq.num_output_tokens + depths[j] < seq.params.min_tokens:
                    logits[b * q + j, banned] = float("-inf")
                    masked = True
        return masked
