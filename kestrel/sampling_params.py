"""SamplingParams: what a request asks of the sampler and of the stop rules."""
from __future__ import annotations

from dataclasses import dataclass, field

from kestrel.errors import KestrelError


@dataclass
class SamplingParams:
    max_tokens: int | None = 16          # None: up to the model's context length
    temperature: float = 1.0             # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1                      # -1 or 0: off
    min_p: float = 0.0
    seed: int | None = None
    n: int = 1
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None          # number of top logprobs per generated token
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature <= 1e-5

    def validate(self) -> None:
        def bad(name: str, value: object, accepted: str) -> KestrelError:
            return KestrelError(f"{name}={value!r} is invalid: expected {accepted}")

        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", self.max_tokens, "an integer >= 1")
        if not 0.0 <= self.temperature <= 100.0:
            raise bad("temperature", self.temperature, "a number in [0, 100]")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", self.top_p, "a number in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", self.top_k, "-1 (off), 0 (off) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", self.min_p, "a number in [0, 1]")
        if not isinstance(self.n, int) or not 1 <= self.n <= 128:
            raise bad("n", self.n, "an integer in [1, 128]")
        if self.min_tokens < 0:
            raise bad("min_tokens", self.min_tokens, "an integer >= 0")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise bad("logprobs", self.logprobs, "an integer in [0, 20]")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", self.stop, "non-empty strings")
