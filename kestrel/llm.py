"""LLM: the offline front door. `LLM(model=None).generate(prompts, SamplingParams(...))`.

`del llm` (or `llm.shutdown()`) gives the engine's memory back (weights, KV cache, CUDA graphs), so a second LLM
fits in the same process.
"""
from __future__ import annotations

import gc
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping

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


# What generate() takes, as vLLM's LLM.generate does: text, token ids, or the prompt dicts TextPrompt
# {"prompt": "..."} and TokensPrompt {"prompt_token_ids": [...]}.
Prompt = str | list[int] | Mapping[str, Any]
_PROMPT_KEYS = ("prompt", "prompt_token_ids")


class LLM:
    """Every EngineConfig field is a keyword here with the same name as its CLI flag."""

    def __init__(self, model: str | None = None, **kwargs) -> None:
        self.engine: Engine | None = None   # first: __del__ runs even when the config or the Engine raises
        self.config = EngineConfig.from_kwargs(model=model, **kwargs)
        self.engine = Engine(self.config, Progress())
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: Prompt | list[Prompt], sampling_params: SamplingParams | list[SamplingParams] | None
                 = None, on_text=None) -> list[RequestOutput]:
        """Generate for each prompt (text, token ids, {"prompt": text} or {"prompt_token_ids": ids}).
        `on_text(request_index, sample_index, delta)` is called as text is produced (the CLI streams with it)."""
        engine = self._require_engine()
        prompt_list = _as_prompt_list(prompts)
        params_list = sampling_params if isinstance(sampling_params, list) else \
            [sampling_params or SamplingParams()] * len(prompt_list)
        if len(params_list) != len(prompt_list):
            raise KestrelError(f"got {len(prompt_list)} prompts but {len(params_list)} SamplingParams")
        results: dict[str, RequestOutput] = {}
        texts: dict[tuple[str, int], TextAssembler] = {}
        order: list[str] = []
        for i, (prompt, params) in enumerate(zip(prompt_list, params_list)):
            text, ids = _prompt_text_and_ids(prompt, i, self.tokenizer)
            rid = uuid.uuid4().hex
            try:
                engine.validate_prompt(ids, params)   # fail before anything is queued
            except KestrelError as exc:
                raise KestrelError(f"prompts[{i}]: {exc}") from None
            results[rid] = RequestOutput(rid, text, ids, [CompletionOutput(j, "", [], None) for j in range(params.n)])
            for j in range(params.n):
                texts[(rid, j)] = TextAssembler(self.tokenizer, params)
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

    def shutdown(self) -> None:
        """Free the engine's memory now (idempotent; `del llm` does the same). generate() fails afterwards."""
        engine, self.engine = self.engine, None
        if engine is not None:
            _release(engine)

    def __del__(self) -> None:
        # At interpreter exit modules may already be torn down: nothing is left to free then.
        try:
            self.shutdown()
        except Exception:   # noqa: BLE001 - a finalizer must not raise
            pass

    def _require_engine(self) -> Engine:
        if self.engine is None:
            raise KestrelError("this LLM was shut down: create a new LLM(...) to generate")
        return self.engine


def _release(engine: Engine) -> None:
    """Drop the engine's device state even where something still refers to the engine or its runner.

    Requests in flight are aborted (their blocks go back). Then every attribute of the runner and the engine is
    dropped: the model, the KV cache, the CUDA graphs and their static buffers, the speculative state. Reference
    cycles among them (a graph's closures and the drafter hold the runner; speculation and the engine's committer
    hold each other) would otherwise keep gigabytes alive until the cycle collector happens to run, and a reference a caller kept (say
    `runner = llm.engine.runner`) would keep all of it. The collector then runs once, and on CUDA the cached
    blocks go back to the driver, so memory_allocated and nvidia-smi both drop.
    """
    runner = getattr(engine, "runner", None)
    device = getattr(runner, "device", None)
    try:
        for request_id in list(getattr(engine, "requests", {})):
            engine.abort_request(request_id)
        if runner is not None and hasattr(runner, "close"):
            runner.close()   # tensor parallelism: the other ranks' processes stop
    finally:   # an abort that raises must not keep the memory
        for obj in (runner, engine):
            if obj is not None and hasattr(obj, "__dict__"):
                obj.__dict__.clear()
        del runner, engine
    gc.collect()
    if device is not None and device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _as_prompt_list(prompts: Prompt | list[Prompt]) -> list[Prompt]:
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]
    if not isinstance(prompts, list) or not prompts:
        raise KestrelError("prompts must be a string, a list of token ids, a {\"prompt\": ...} or "
                           "{\"prompt_token_ids\": [...]} dict, or a non-empty list of those")
    return prompts


def _prompt_text_and_ids(prompt: Prompt, i: int, tokenizer) -> tuple[str | None, list[int]]:
    """(text, token ids) of prompts[i]; text is None for a token-id prompt. Out-of-vocabulary ids are caught by
    the engine's own check (EngineLimits), like every other limit."""
    if isinstance(prompt, Mapping):
        unknown = sorted(set(prompt) - set(_PROMPT_KEYS))
        given = [k for k in _PROMPT_KEYS if k in prompt]
        if unknown or len(given) != 1:
            why = f"unknown key(s) {unknown}" if unknown else f"{len(given)} of the keys"
            raise KestrelError(f"prompts[{i}]: a prompt dict takes exactly one of {list(_PROMPT_KEYS)}; "
                               f"got {why} in {sorted(prompt)}")
        if given == ["prompt"]:
            prompt = prompt["prompt"]
            if not isinstance(prompt, str):
                raise KestrelError(f"prompts[{i}]: \"prompt\" must be a string, got {type(prompt).__name__}")
        else:
            prompt = prompt["prompt_token_ids"]
            if not isinstance(prompt, (list, tuple)) or not prompt:
                raise KestrelError(f"prompts[{i}]: \"prompt_token_ids\" must be a non-empty list of token ids, "
                                   f"got {prompt!r}")
    if isinstance(prompt, str):
        return prompt, tokenizer.encode(prompt)
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return None, list(prompt)
    raise KestrelError(f"prompts[{i}] is invalid: expected a string, a list of token ids, {{\"prompt\": text}} or "
                       f"{{\"prompt_token_ids\": [ids]}}, got {type(prompt).__name__}")
