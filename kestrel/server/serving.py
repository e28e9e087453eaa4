"""What /v1/completions and /v1/chat/completions share: request -> SamplingParams, submission to the AsyncEngine,
per-choice accumulation, usage, metrics, and OpenAI-format errors.

A request with several prompts (completions) becomes one engine request per prompt; choice index is
`prompt_index * n + sample_index`, as in the OpenAI API.
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from kestrel.frontend.async_engine import (AsyncEngine, Delta, EngineFailure, EngineNotReady, EngineOverloaded,
                                         RequestStream)
from kestrel.errors import KestrelError
from kestrel.frontend.first_token import FirstTokenTrace
from kestrel.sampling_params import SamplingParams
from kestrel.server.log_lines import request_line
from kestrel.server.metrics import SampleTiming, ServerMetrics
from kestrel.server.protocol import PromptTokensDetails, Usage, error_body

DONE = "data: [DONE]\n\n"

logger = logging.getLogger("kestrel.server")


class APIError(Exception):
    """An error answered in OpenAI's format; 4xx for the client's mistakes, 503 when busy or starting."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


QUEUE_FULL_RETRY_AFTER_S = 1   # a full queue drains as requests get their first token: seconds, not minutes


def api_error_from(exc: BaseException, param: str | None = None) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineOverloaded):
        # Retry-After: a client (the openai SDK among them) waits that long before its retry, instead of at once
        return APIError(503, str(exc), "service_unavailable_error", code="queue_full",
                        headers={"Retry-After": str(QUEUE_FULL_RETRY_AFTER_S)})
    if isinstance(exc, EngineNotReady):
        return APIError(503, str(exc), "service_unavailable_error", code="not_ready")
    if isinstance(exc, EngineFailure):
        return APIError(500, str(exc), "internal_server_error", code="engine_error")
    if isinstance(exc, KestrelError):
        return APIError(400, str(exc), param=_param_named_in(str(exc)) or param)
    logger.error("internal error answered as a 500", exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}: {without_paths(str(exc))}", "internal_server_error")


_PATH = re.compile(r"(?:[A-Za-z]:)?[/\\](?:[\w.\-~]+[/\\])+[\w.\-~]*")


def without_paths(message: str) -> str:
    """An exception's message with the server's file paths cut out (a client has no business with them)."""
    return _PATH.sub("<path>", message)


def _param_named_in(message: str) -> str | None:
    """SamplingParams messages start with `name=value is invalid`: that name is the OpenAI `param`."""
    m = re.match(r"(\w+)=", message)
    return m.group(1) if m else None


# One request's sequences (prompts x n) at most: each is an engine request holding its own KV blocks and output, so
# one POST of {"prompt": [...10000 prompts], "n": 128} would otherwise queue 1.28 M sequences. OpenAI caps n at 128.
MAX_SEQUENCES_PER_REQUEST = 1024


def check_sequences(num_prompts: int, n: int) -> None:
    """400 when a request would create more than MAX_SEQUENCES_PER_REQUEST sequences."""
    if num_prompts * n > MAX_SEQUENCES_PER_REQUEST:
        what = f"{num_prompts} prompts x n={n}" if num_prompts > 1 else f"n={n}"
        raise APIError(400, f"{what} is {num_prompts * n} sequences, more than the {MAX_SEQUENCES_PER_REQUEST} one "
                       "request may create: split it into several requests",
                       param="n" if num_prompts == 1 else "prompt")


def stop_strings(stop: str | list[str] | None) -> list[str]:
    """`stop` as a list without empty strings: `""` and `[""]` both mean no stop string (as `null` does), where an
    empty stop string would otherwise end every generation before its first token (SamplingParams refuses it)."""
    if isinstance(stop, str):
        stop = [stop]
    return [s for s in stop or [] if s]


def sampling_params(req, max_tokens: int | None, logprobs: int | None,
                    field_names: dict[str, str] | None = None) -> SamplingParams:
    """The request's sampling fields as SamplingParams; range errors become 400 naming the field.

    `field_names`: SamplingParams name -> the request's name for it where they differ (chat's top_logprobs is
    SamplingParams.logprobs), so the error names the field the client sent."""
    field_names = field_names or {}
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name):
            raise APIError(400, f"{name}={getattr(req, name)} is not supported: Kestrel has no penalties yet "
                                "(send 0 or leave it out)", param=name)
    try:
        if max_tokens is not None and max_tokens < 1:
            raise KestrelError(f"max_tokens={max_tokens} is invalid: expected an integer >= 1")
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=-1 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            seed=req.seed, n=req.n, stop=stop_strings(req.stop), stop_token_ids=req.stop_token_ids or [],
            ignore_eos=req.ignore_eos, min_tokens=req.min_tokens, logprobs=logprobs,
            skip_special_tokens=req.skip_special_tokens,
        )
    except KestrelError as exc:
        error = api_error_from(exc)
        if error.param in field_names:
            alias = field_names[error.param]
            error.message = error.message.replace(f"{error.param}=", f"{alias}=", 1)
            error.param = alias
        raise error from None


def check_model(requested: str | None, served: str) -> None:
    if requested is not None and requested != served:
        raise APIError(404, f"the model `{requested}` does not exist; this server serves `{served}`",
                       param="model", code="model_not_found")


# ---- running a request ----------------------------------------------------------------------------------------

@dataclass
class Choice:
    """One output choice as it accumulates."""
    index: int
    timing: SampleTiming
    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    logprobs: list = field(default_factory=list)   # TokenLogprob per token, when asked
    finish_reason: str | None = None


class Generation:
    """One HTTP request in the engine: its prompts' streams merged into (choice, delta) events."""

    def __init__(self, engine: AsyncEngine, metrics: ServerMetrics, prompts: list[list[int]],
                 params: SamplingParams, kind: str, log_request: bool = False,
                 trace: FirstTokenTrace | None = None) -> None:
        self.engine = engine
        self.log_request = log_request   # one log line once every choice has finished
        self.metrics = metrics
        self.prompts = prompts
        self.params = params
        self.id = f"{kind}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        # arrival: when the HTTP request arrived (parsing and tokenizing count towards TTFT), where it is known
        self.trace = trace if trace is not None else FirstTokenTrace(time.monotonic())
        self.arrival = self.trace.received
        self._trace_observed = False
        n = params.n
        self.choices = [Choice(i, SampleTiming(self.arrival)) for i in range(len(prompts) * n)]
        self.cached_tokens = [0] * len(prompts)
        self._streams: list[RequestStream] = []
        self._submitted = False

    async def start(self) -> None:
        """Submit every prompt; a refusal (bad input, queue full) aborts the ones already in."""
        try:
            for i, ids in enumerate(self.prompts):
                self._streams.append(await self.engine.submit(ids, self.params, f"{self.id}-{i}", self.trace))
            self._submitted = True
        except BaseException:
            self.close()
            raise

    async def events(self) -> AsyncIterator[tuple[Choice, Delta]]:
        """(choice, delta) in arrival order across prompts; each choice's state is updated before it is yielded."""
        if len(self._streams) == 1:
            async for delta in self._streams[0]:
                yield self._choice(0, delta), delta
            return
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(prompt_index: int, stream: RequestStream) -> None:
            try:
                async for delta in stream:
                    merged.put_nowait((prompt_index, delta))
            except BaseException as exc:   # noqa: BLE001 - re-raised by the reader
                merged.put_nowait((prompt_index, exc))
            finally:
                merged.put_nowait((prompt_index, None))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(self._streams)]
        try:
            open_streams = len(tasks)
            while open_streams:
                prompt_index, item = await merged.get()
                if item is None:
                    open_streams -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield self._choice(prompt_index, item), item
        finally:
            for t in tasks:
                t.cancel()

    def _choice(self, prompt_index: int, delta: Delta) -> Choice:
        choice = self.choices[prompt_index * self.params.n + delta.index]
        now = time.monotonic()
        timing = choice.timing
        if delta.index == 0:
            self.cached_tokens[prompt_index] = delta.num_cached_tokens
        if delta.queue_time_s is not None:
            timing.queue_time_s = delta.queue_time_s
        if delta.token_ids:
            if timing.first_token_time is None:
                timing.first_token_time = now
                if self.trace.detokenized is None:
                    self.trace.detokenized = now
            choice.num_tokens += len(delta.token_ids)
        choice.text.append(delta.text)
        if delta.logprobs:
            choice.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            choice.finish_reason = delta.finish_reason
            timing.finish_time, timing.num_tokens, timing.finish_reason = now, choice.num_tokens, delta.finish_reason
            self.metrics.observe_sample(timing)
            self._log_if_finished()
        return choice

    def _log_if_finished(self) -> None:
        if not self.log_request or any(c.finish_reason is None for c in self.choices):
            return
        self.log_request = False   # once
        first = [c.timing.first_token_time for c in self.choices if c.timing.first_token_time is not None]
        usage = self.usage()
        logger.info("%s", request_line(self.id, usage.prompt_tokens, usage.completion_tokens,
                                       min(first) - self.arrival if first else None,
                                       time.monotonic() - self.arrival, [c.finish_reason for c in self.choices]))

    def usage(self) -> Usage:
        prompt_tokens = sum(len(p) for p in self.prompts)
        completion_tokens = sum(c.num_tokens for c in self.choices)
        return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(self.cached_tokens)))

    def first_chunk_written(self) -> None:
        """Streamed: a chunk went out to the transport; the first one after the first token ends the trace."""
        if self.trace.written is None and self.trace.detokenized is not None:
            self.trace.written = time.monotonic()
            self._observe_trace()

    def _observe_trace(self) -> None:
        if not self._trace_observed and self.trace.detokenized is not None:   # once, and only with a token
            self._trace_observed = True
            self.metrics.observe_first_token(self.trace)

    def close(self) -> None:
        """Abort whatever has not finished (client gone, error, shutdown); frees its KV blocks. Synchronous:
        it runs in `finally` blocks of cancelled tasks."""
        for stream in self._streams:
            stream.close()
        self._observe_trace()   # non-streamed: every stage but sse_write
        if self._submitted:   # choices cut short count as aborted in kestrel:request_success_total
            self._submitted = False
            now = time.monotonic()
            for c in self.choices:
                if c.finish_reason is None:
                    c.finish_reason = c.timing.finish_reason = "abort"
                    c.timing.finish_time, c.timing.num_tokens = now, c.num_tokens
                    self.metrics.observe_sample(c.timing)
            self._log_if_finished()


async def run_to_completion(generation: Generation, receive) -> bool:
    """Drain a non-streaming generation; False (and the request aborted) if the client disconnected first."""
    async def drain() -> None:
        async for _ in generation.events():
            pass

    async def wait_disconnect() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    work = asyncio.create_task(drain())
    watch = asyncio.create_task(wait_disconnect())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
        await asyncio.gather(work, return_exceptions=True)
        generation.close()
    if work.cancelled():
        return False
    work.result()   # re-raise an engine failure
    return True


async def framed_stream(gen: Generation, head: dict, include_usage: bool,
                        chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """The SSE frame both endpoints share: their chunks, the usage chunk when asked, an in-band error if the
    generation fails after the headers went out (as vLLM does), then [DONE]; the generation is closed either way."""
    try:
        async for chunk in chunks:
            # stamped as the chunk leaves for the connection, not when this generator resumes after the write:
            # on a busy host the resume can come after the client has the bytes, so the stamp would not be causal
            gen.first_chunk_written()
            yield chunk
        if include_usage:
            yield sse(json.dumps(dict(head, choices=[], usage=gen.usage().model_dump())))
    except Exception as exc:   # noqa: BLE001 - headers are sent: report in-band
        yield sse(json.dumps(api_error_from(exc).body()))
    finally:
        gen.close()
    yield DONE


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


class TokenText:
    """Token id -> its text for logprobs (cached: a vocabulary is finite and tokens repeat)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text
