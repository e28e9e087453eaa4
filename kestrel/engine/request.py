"""Sequence: one sample of a request (a request with n > 1 owns n sequences) and its place in the KV cache."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from kestrel.engine.messages import TokenLogprob  # noqa: F401 - re-exported
from kestrel.sampling_params import SamplingParams
from kestrel.structured.matcher import SequenceGrammar


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    index: int                        # sample index within the request, 0..n-1
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0      # tokens whose K/V are in the cache
    num_cached_tokens: int = 0        # prompt tokens the prefix cache supplied at admission
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    generator: torch.Generator | None = None  # per-request seed: same seed, same samples
    prefill_leader: "Sequence | None" = None  # sample 0 of the request, for samples 1..n-1
    grammar: SequenceGrammar | None = None    # structured output: where the committed tokens stand in the grammar

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def tokens_at(self, start: int, count: int) -> list[int]:
        """token_ids()[start:start + count] without copying the whole sequence (a decode step reads one)."""
        prompt = self.prompt_token_ids
        if start >= len(prompt):
            return self.output_token_ids[start - len(prompt):start - len(prompt) + count]
        if start + count <= len(prompt):
            return prompt[start:start + count]
        return prompt[start:] + self.output_token_ids[:start + count - len(prompt)]

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED
