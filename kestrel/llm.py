"""LLM: the offline front door. `LLM(model=None).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from kestrel.config import EngineConfig
from kestrel.engine.engine import Engine
from kestrel.frontend.output import TextAssembler
from kestrel.engine.request import TokenLogprob
from kestrel.errors import KestrelError
from kestrel.progress import Progress
from kestrel.sampling_params import SamplingParams


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_s(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    finished: bool = False
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.monotonic()))


Prompt = str | list[int]


class LLM:
    """Every EngineConfig field is a keyword here with the same name as its CLI flag."""

    def __init__(self, model: str | None = None, **kwargs) -> None:
        self.config = EngineConfig.from_kwargs(model=model, **kwargs)
        self.engine = Engine(self.config, Progress())
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: Prompt | list[Prompt], sampling_params: SamplingParams | list[SamplingParams] | None
                 = None, on_text=None) -> list[RequestOutput]:
        """Generate for each prompt (text or token ids). `on_text(request_index, sample_index, delta)` is called
        as text is produced (the CLI streams with it)."""
        prompt_list = _as_prompt_list(prompts)
        params_list = sampling_params if isinstance(sampling_params, list) else \
            [sampling_params or SamplingParams()] * len(prompt_list)
        if len(params_list) != len(prompt_list):
            raise KestrelError(f"got {len(prompt_list)} prompts but {len(params_list)} SamplingParams")
        results: dict[str, RequestOutput] = {}
        texts: dict[tuple[str, int], TextAssembler] = {}
        order: list[str] = []
        engine = self.engine
        for prompt, params in zip(prompt_list, params_list):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            rid = uuid.uuid4().hex
            engine.validate_prompt(ids, params)   # fail before anything is queued
            results[rid] = RequestOutput(rid, prompt if isinstance(prompt, str) else None, ids,
                                         [CompletionOutput(i, "", [], None) for i in range(params.n)])
            for i in range(params.n):
                texts[(rid, i)] = TextAssembler(self.tokenizer, params)
            order.append(rid)
        for rid, params in zip(order, params_list):
            engine.add_request(rid, results[rid].prompt_token_ids, params)
        index_of = {rid: i for i, rid in enumerate(order)}
        while engine.has_unfinished():
            for up in engine.step():
                res = results[up.request_id]
                out = res.outputs[up.index]
                out.token_ids += up.new_token_ids
                if up.new_logprobs is not None:
                    out.logprobs = (out.logprobs or []) + up.new_logprobs
                if res.metrics.first_token_time is None and up.new_token_ids:
                    res.metrics.first_token_time = time.monotonic()
                res.num_cached_tokens = up.num_cached_tokens
                assembler = texts[(up.request_id, up.index)]
                delta, stop_hit = assembler.add(up.new_token_ids)
                if stop_hit and not up.finished:
                    engine.finish_sample(up.request_id, up.index)
                if up.finished or stop_hit:
                    delta += assembler.flush()
                    out.finish_reason = "stop" if stop_hit else up.finish_reason
                out.text = assembler.text if (up.finished or stop_hit) else out.text + delta
                if on_text is not None and delta:
                    on_text(index_of[up.request_id], up.index, delta)
                if all(o.finish_reason is not None for o in res.outputs) and not res.finished:
                    res.finished = True
                    res.metrics.finished_time = time.monotonic()
        return [results[rid] for rid in order]


def _as_prompt_list(prompts: Prompt | list[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]
    if not isinstance(prompts, list) or not prompts:
        raise KestrelError("prompts must be a string, a list of token ids, or a non-empty list of those")
    return prompts
