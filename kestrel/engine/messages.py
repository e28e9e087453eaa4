"""What the engine hands out, as plain data without torch: per-step SampleUpdates, EngineStats, the limits a prompt
is checked against, and the compact tuples these travel as between the engine core and the server.

The server process never imports torch: it validates prompts with EngineLimits (the numbers the engine reports
once ready) and rebuilds these objects from tuples, one message per engine step.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from itertools import repeat

from kestrel.errors import KestrelError
from kestrel.sampling_params import SamplingParams


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]     # (token_id, logprob), best first


@dataclass(slots=True)
class SampleUpdate:
    request_id: str
    index: int
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_used_blocks: int
    num_total_blocks: int
    num_preemptions: int
    prompt_tokens_total: int
    generation_tokens_total: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    # Speculative decoding, cumulative since start (0 / () when the engine does not speculate). A draft is one
    # sequence's proposal in one verify step: acceptance length = 1 + accepted / drafts, counting the bonus token.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()   # [i]: drafts whose token at draft position i was accepted
    # Triton kernels built (or loaded from the disk cache) after the engine reported ready: a request waited for
    # each (kernels/compile_watch.py); 0 when startup warmed every shape traffic reached
    kernel_builds_after_ready: int = 0


@dataclass(frozen=True, slots=True)
class EngineLimits:
    """What decides whether a prompt can ever run; known once the engine has sized its KV cache."""
    max_model_len: int
    vocab_size: int
    kv_capacity_tokens: int          # num_blocks * block_size

    def check_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise KestrelError for a request that could never run; the server maps it to HTTP 400."""
        n = len(prompt_token_ids)
        if n == 0:
            raise KestrelError("the prompt is empty: at least one token is needed")
        vocab = self.vocab_size
        # Scanned in C (map, min, max: ~4 us for 128 tokens, a Python loop ~18 us): this runs on every request's
        # path to its first token, twice (the server, then the engine's backstop); the loop only names the culprit.
        if not (all(map(isinstance, prompt_token_ids, repeat(int))) and min(prompt_token_ids) >= 0
                and max(prompt_token_ids) < vocab):
            bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab]
            raise KestrelError(f"prompt token id {bad[0]!r} is out of range: expected integers in [0, {vocab})")
        bad = [t for t in params.stop_token_ids if not 0 <= t < vocab]
        if bad:
            raise KestrelError(f"stop_token_ids={bad!r} is invalid: expected token ids in [0, {vocab})")
        if n >= self.max_model_len:
            raise KestrelError(f"the prompt has {n} tokens but this model's maximum context length is "
                               f"{self.max_model_len} tokens (prompt and completion together)")
        if params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
            raise KestrelError(f"this model's maximum context length is {self.max_model_len} tokens, but "
                               f"{n + params.max_tokens} were requested ({n} in the prompt, {params.max_tokens} "
                               "for the completion); reduce max_tokens or the prompt")
        if params.min_tokens > self.max_model_len - n:
            raise KestrelError(f"min_tokens={params.min_tokens} is invalid: expected at most {self.max_model_len - n} "
                               f"(this model's context of {self.max_model_len} tokens less the prompt's {n})")
        capacity = self.kv_capacity_tokens
        total = n + (params.max_tokens or self.max_model_len - n)
        if min(total, self.max_model_len) > capacity:
            raise KestrelError(f"a sequence of {total} tokens cannot fit in the KV cache ({capacity} tokens); "
                               "raise --kv-cache-memory / --gpu-memory-utilization or lower max_tokens")


# ---- wire forms: tuples pickle several times faster than dataclasses ---------------------------------------------
#   update: (request_id, index, new_token_ids, logprobs, finished, finish_reason, num_prompt_tokens,
#            num_cached_tokens, first_stamps)
#     logprobs: None or [(token_id, logprob, [(token_id, logprob), ...]), ...]
#     first_stamps: on a sample's first update, its (arrival, first scheduled, first token) time.monotonic()
#       stamps (one clock for every process of the host: the server subtracts its own from them); else None
#   step event: ("step", [update, ...], stats, emitted): emitted, time.monotonic() as the event is sent
#   stats: EngineStats's fields in declaration order (a new field travels without a change here)

def encode_sample(u: SampleUpdate, first_stamps: tuple[float, float, float | None] | None) -> tuple:
    lps = None if u.new_logprobs is None else [(lp.token_id, lp.logprob, lp.top) for lp in u.new_logprobs]
    return (u.request_id, u.index, u.new_token_ids, lps, u.finished, u.finish_reason, u.num_prompt_tokens,
            u.num_cached_tokens, first_stamps)


def decode_logprobs(wire: list[tuple] | None) -> list[TokenLogprob] | None:
    return None if wire is None else [TokenLogprob(t, lp, top) for t, lp, top in wire]


_STATS_FIELDS = tuple(f.name for f in fields(EngineStats))


def encode_stats(stats: EngineStats) -> tuple:
    return tuple(getattr(stats, name) for name in _STATS_FIELDS)


def decode_stats(wire: tuple | None) -> EngineStats | None:
    return None if wire is None else EngineStats(*wire)
