"""Async load generator for OpenAI-compatible servers: one coroutine per request, per-request timings.

Errors (HTTP status, broken stream, timeout) are recorded on the request and never stop the run.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import aiohttp

from kestrel.bench.datasets import BenchRequest
from kestrel.bench.metrics import reconcile_chunk_tokens, token_gaps
from kestrel.bench.progress import RunProgress
from kestrel.bench.tokenizer import BenchTokenizer
from kestrel.errors import KestrelError


@dataclass(frozen=True, slots=True)
class ApiOptions:
    base_url: str
    model: str
    endpoint: str = "completions"          # completions | chat
    stream: bool = True
    ignore_eos: bool = True                # also sends min_tokens = max_tokens, so every request runs full length
    include_usage: bool = True             # stream_options.include_usage
    continuous_usage: bool = True          # stream_options.continuous_usage_stats: token count on every chunk
    timeout_s: float = 600.0

    @property
    def url(self) -> str:
        path = "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"
        return self.base_url.rstrip("/") + path

    def payload(self, req: BenchRequest) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "max_tokens": req.output_len, "temperature": 0.0,
                                "stream": self.stream}
        if self.endpoint == "chat":
            assert isinstance(req.prompt, str), "chat prompts are text (the datasets build them so)"
            body["messages"] = [{"role": "user", "content": req.prompt}]
        else:
            body["prompt"] = req.prompt   # text, or token ids: the server then sees exactly these tokens
        if self.ignore_eos:
            body["ignore_eos"] = True
            body["min_tokens"] = req.output_len
        if self.stream and self.include_usage:
            body["stream_options"] = {"include_usage": True}
            if self.continuous_usage:
                body["stream_options"]["continuous_usage_stats"] = True
        return body


@dataclass(slots=True)
class RequestRecord:
    """One request's timings. Times are seconds; start is relative to the run start, the rest to `start`."""
    prompt_len: int                     # client estimate, replaced by usage.prompt_tokens when reported
    max_tokens: int
    start: float = 0.0
    ttft: float | None = None           # streamed only
    e2e: float | None = None
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int | None = None    # usage.prompt_tokens_details.cached_tokens, when the server reports it
    token_source: str = "chunks"        # usage | tokenizer | chunks | words (see count_tokens)
    chunk_token_source: str | None = None   # streamed: usage (per-chunk usage) | tokenizer | one-per-chunk
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    output_chars: int = 0
    success: bool = False
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _chunk_text(choice: dict[str, Any]) -> str:
    if "text" in choice:
        return choice.get("text") or ""
    delta = choice.get("delta") or choice.get("message") or {}
    return (delta.get("content") or "") + (delta.get("reasoning_content") or "")


class _StreamState:
    """Folds SSE chunks into a record: token arrivals, text, usage."""

    def __init__(self, tokenizer: BenchTokenizer | None, on_tokens: Callable[[int], None] | None = None) -> None:
        self.tokenizer = tokenizer
        self.on_tokens = on_tokens                # the progress line's live token count
        self.text: list[str] = []
        self.usage_tokens: int | None = None     # last completion_tokens seen (cumulative)
        self.prompt_tokens: int | None = None
        self.cached_tokens: int | None = None
        self.finish_reason: str | None = None
        self.per_chunk_usage = False

    def add(self, obj: dict[str, Any], now: float, record: RequestRecord) -> None:
        if obj.get("error"):
            raise RuntimeError(f"server error in stream: {obj['error']}")
        choices = obj.get("choices") or []
        text = "".join(_chunk_text(c) for c in choices)
        for c in choices:
            self.finish_reason = c.get("finish_reason") or self.finish_reason
        usage = obj.get("usage") or {}
        tokens = None
        if usage.get("completion_tokens") is not None:
            total = int(usage["completion_tokens"])
            if choices:   # continuous usage: this chunk's tokens are the growth of the running count
                tokens = total - (self.usage_tokens or 0)
                self.per_chunk_usage = True
            self.usage_tokens = total
        if usage.get("prompt_tokens") is not None:
            self.prompt_tokens = int(usage["prompt_tokens"])
        self.cached_tokens = _cached_tokens(usage) if usage else self.cached_tokens
        if tokens is None:
            tokens = (max(1, self.tokenizer.count(text)) if self.tokenizer else 1) if text else 0
        self.text.append(text)
        if tokens > 0:
            record.chunk_times.append(now)
            record.chunk_tokens.append(tokens)
            if self.on_tokens:
                self.on_tokens(tokens)


def _cached_tokens(usage: dict[str, Any]) -> int | None:
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return int(cached) if cached is not None else None


def count_tokens(record: RequestRecord, text: str, usage_tokens: int | None,
                 tokenizer: BenchTokenizer | None) -> None:
    """Output token count: server usage, else the tokenizer on the whole text, else the client's chunk count."""
    if usage_tokens is not None:
        record.output_tokens, record.token_source = usage_tokens, "usage"
    elif tokenizer is not None:
        record.output_tokens, record.token_source = tokenizer.count(text), "tokenizer"
    elif record.chunk_tokens:
        record.output_tokens, record.token_source = sum(record.chunk_tokens), "chunks"
    else:
        record.output_tokens, record.token_source = len(text.split()), "words"


async def send_request(session: aiohttp.ClientSession, api: ApiOptions, req: BenchRequest,
                       tokenizer: BenchTokenizer | None = None, run_start: float = 0.0,
                       on_tokens: Callable[[int], None] | None = None) -> RequestRecord:
    record = RequestRecord(prompt_len=req.prompt_len, max_tokens=req.output_len)
    start = time.perf_counter()
    record.start = start - run_start
    try:
        async with session.post(api.url, json=api.payload(req)) as resp:
            if resp.status != 200:
                body = (await resp.text())[:300]
                raise RuntimeError(f"HTTP {resp.status}: {body}")
            if api.stream:
                state = _StreamState(tokenizer, on_tokens)
                async for raw in resp.content:   # aiohttp yields whole lines, however TCP split them
                    now = time.perf_counter() - start
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue                 # blank separators, ": keep-alive" comments, event: lines
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    state.add(json.loads(data), now, record)
                text, usage_tokens, prompt_tokens = "".join(state.text), state.usage_tokens, state.prompt_tokens
                record.cached_tokens = state.cached_tokens
                record.finish_reason = state.finish_reason
                record.chunk_token_source = ("usage" if state.per_chunk_usage else
                                             "tokenizer" if tokenizer else "one-per-chunk")
                if usage_tokens is not None and not state.per_chunk_usage:
                    record.chunk_tokens = reconcile_chunk_tokens(record.chunk_tokens, usage_tokens)
            else:
                obj = await resp.json(content_type=None)
                if obj.get("error"):
                    raise RuntimeError(f"server error: {obj['error']}")
                choices = obj.get("choices") or []
                text = "".join(_chunk_text(c) for c in choices)
                record.finish_reason = choices[0].get("finish_reason") if choices else None
                usage = obj.get("usage") or {}
                usage_tokens, prompt_tokens = usage.get("completion_tokens"), usage.get("prompt_tokens")
                record.cached_tokens = _cached_tokens(usage)
        record.e2e = time.perf_counter() - start
        count_tokens(record, text, usage_tokens, tokenizer)
        record.prompt_tokens = int(prompt_tokens) if prompt_tokens is not None else req.prompt_len
        record.output_chars = len(text)
        if api.stream:
            if not record.chunk_times:
                raise RuntimeError("stream ended without any token")
            record.ttft = record.chunk_times[0]
            record.itl = token_gaps(record.chunk_times, record.chunk_tokens)
        record.success = True
    except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError, ValueError, KeyError, TypeError) as exc:
        record.e2e = time.perf_counter() - start
        record.error = f"{type(exc).__name__}: {exc}"[:400] if str(exc) else type(exc).__name__
    return record


def new_session(api: ApiOptions) -> aiohttp.ClientSession:
    # limit=0: no connection-pool cap, the load shape decides the concurrency.
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                 timeout=aiohttp.ClientTimeout(total=api.timeout_s))


async def probe_features(api: ApiOptions) -> ApiOptions:
    """Find what the server accepts: drop ignore_eos/min_tokens and usage options it rejects (HTTP 4xx).

    Raises KestrelError when not even a plain request works (wrong URL or model, server down).
    """
    candidates = [api, replace(api, continuous_usage=False), replace(api, ignore_eos=False, continuous_usage=False),
                  replace(api, ignore_eos=False, include_usage=False, continuous_usage=False)]
    tiny = BenchRequest("Hello", 1, 2)
    last_error = None
    async with new_session(api) as session:
        for candidate in candidates:
            record = await send_request(session, candidate, tiny)
            if record.success:
                return candidate
            last_error = record.error
            if not (record.error or "").startswith("RuntimeError: HTTP 4"):
                break   # a connection error or 5xx will not go away by dropping options
    raise KestrelError(f"--base-url {api.base_url!r} with model {api.model!r} does not answer a plain "
                       f"{api.endpoint} request: {last_error}")


def _arrival_gaps(rate: float, burstiness: float, rng: random.Random) -> Iterator[float]:
    """Inter-arrival times: gamma(shape=burstiness, mean=1/rate); burstiness 1 is a Poisson process."""
    while True:
        yield 0.0 if rate == float("inf") else rng.gammavariate(burstiness, 1.0 / (rate * burstiness))


async def run_load(api: ApiOptions, requests: Sequence[BenchRequest], concurrency: int | None = None,
                   request_rate: float = float("inf"), burstiness: float = 1.0, duration_s: float | None = None,
                   tokenizer: BenchTokenizer | None = None, seed: int = 0,
                   progress: bool = True, name: str = "run") -> tuple[list[RequestRecord], float]:
    """Send `requests` (cycled while `duration_s` lasts, when given); return the records and the run duration.

    concurrency caps requests in flight; request_rate spaces arrivals (inf: all at once, the cap decides).
    """
    if not requests:
        raise KestrelError("the dataset is empty: expected --num-prompts >= 1")
    assert duration_s is None or concurrency or request_rate != float("inf"), "an unbounded duration run"
    rng = random.Random(seed)
    limit = asyncio.Semaphore(concurrency) if concurrency else None
    records: list[RequestRecord] = []
    async with new_session(api) as session:
        bar = RunProgress(name, None if duration_s else len(requests), duration_s, enabled=progress,
                          expected_tokens=None if duration_s else sum(r.output_len for r in requests),
                          streamed=api.stream)
        run_start = bar.start
        deadline = run_start + duration_s if duration_s else None

        async def one(req: BenchRequest) -> None:
            live = 0

            def on_tokens(n: int) -> None:
                nonlocal live
                live += n
                bar.add_tokens(n)

            try:
                record = await send_request(session, api, req, tokenizer, run_start, on_tokens)
                records.append(record)
                # the final count (usage) replaces the live one, which a client-side tokenizer only estimated
                bar.update(record.success, record.output_tokens - live if record.success else 0)
            finally:
                if limit:
                    limit.release()

        async def redraw() -> None:   # the line moves before any request finishes
            while True:
                await asyncio.sleep(0.2)
                bar.tick()

        ticker = asyncio.create_task(redraw()) if progress else None

        tasks = []
        gaps = _arrival_gaps(request_rate, burstiness, rng)
        index = 0
        while deadline is not None or index < len(requests):
            if deadline is not None and time.perf_counter() >= deadline:
                break
            gap = next(gaps)
            if gap:
                await asyncio.sleep(gap)
            if limit:
                await limit.acquire()
            if deadline is not None and time.perf_counter() >= deadline:
                if limit:
                    limit.release()
                break
            tasks.append(asyncio.create_task(one(requests[index % len(requests)])))
            bar.request_sent()
            index += 1
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - run_start
        if ticker:
            ticker.cancel()
    bar.close()
    records.sort(key=lambda r: r.start)
    return records, duration


async def warmup(api: ApiOptions, requests: Sequence[BenchRequest], num: int, concurrency: int | None) -> None:
    """Send `num` unrecorded requests so the measured run starts on a warm server."""
    if num > 0:
        await run_load(api, [requests[i % len(requests)] for i in range(num)], concurrency or num, progress=False)
