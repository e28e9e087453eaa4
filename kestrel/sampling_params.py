"""SamplingParams: what a request asks of the sampler and of the stop rules."""
from __future__ import annotations

from dataclasses import dataclass, field

from kestrel.errors import KestrelError

# Seeds are 64-bit signed, as vLLM's (torch.long): sample i of a request draws from a generator seeded seed + i,
# so seed + n - 1 must fit as well.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
TOP_K_MAX = 2**31 - 1      # the sampler packs top_k through a float32 tensor; larger values mean "off" anyway
# A temperature at or below this is greedy (the argmax): the request's flag, the sampler, speculative verification
# and the engine's greedy fast paths all decide with this one number, so they never disagree on a row.
GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the generated text (issue 54): exactly one field set. The server maps OpenAI's
    `response_format`, vLLM's `guided_*` / `structured_outputs` and SGLang's `regex` / `ebnf` / `json_schema` onto
    it; tool calls with `tool_choice` "required" or a named function set `json_schema`. Compiled by xgrammar."""
    json_schema: str | None = None       # a JSON schema, serialized
    json_object: bool = False            # any JSON object
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None           # EBNF (GBNF as xgrammar reads it)

    def __post_init__(self) -> None:
        given = [self.json_schema is not None, self.json_object, self.regex is not None, self.choice is not None,
                 self.grammar is not None]
        if sum(given) != 1:
            raise KestrelError("a structured output names exactly one of json_schema, json_object, regex, choice "
                               f"and grammar ({sum(given)} given)")


@dataclass
class SamplingParams:
    max_tokens: int | None = 16          # None: up to the model's context length
    temperature: float = 1.0             # <= GREEDY_TEMPERATURE (0) means greedy
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
    structured_output: StructuredOutput | None = None   # constrained decoding (issue 54)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature <= GREEDY_TEMPERATURE

    def validate(self) -> None:
        def bad(name: str, value: object, accepted: str) -> KestrelError:
            return KestrelError(f"{name}={value!r} is invalid: expected {accepted}")

        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", self.max_tokens, "an integer >= 1")
        if not 0.0 <= self.temperature <= 100.0:
            raise bad("temperature", self.temperature, "a number in [0, 100]")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", self.top_p, "a number in (0, 1]")
        if not isinstance(self.top_k, int) or not -1 <= self.top_k <= TOP_K_MAX:
            raise bad("top_k", self.top_k, f"-1 (off), 0 (off) or a positive integer up to {TOP_K_MAX}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", self.min_p, "a number in [0, 1]")
        if not isinstance(self.n, int) or not 1 <= self.n <= 128:
            raise bad("n", self.n, "an integer in [1, 128]")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", self.min_tokens, "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", self.min_tokens, f"an integer <= max_tokens ({self.max_tokens})")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not SEED_MIN <= self.seed <= SEED_MAX - (self.n - 1)):
            raise bad("seed", self.seed, f"an integer in [{SEED_MIN}, {SEED_MAX - (self.n - 1)}] (sample i is seeded "
                      f"with seed + i, so seed + n - 1 must not exceed {SEED_MAX})")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", self.stop_token_ids, "non-negative token ids")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise bad("logprobs", self.logprobs, "an integer in [0, 20]")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", self.stop, "non-empty strings")
