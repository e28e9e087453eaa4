"""AsyncEngine: the asyncio front door of the engine core, which runs in its own process (processes and pipes
are drawn in frontend/engine_process.py; the message protocol is listed in engine/core.py).

    event loop (HTTP handlers)                            engine core
    ─────────────────────────                             ───────────
    submit() ─ EngineLimits.check_prompt (400s here) ─ ("add", ...) ──────► engine.add_request
    abort()  ─ ("abort", id) ────────────────────────────────────────────► engine.abort_request
    stop string ─ ("finish", id, i) ─────────────────────────────────────► engine.finish_sample
    RequestStream.queue ◄── _on_event ◄── ("step", update tuples, stats) ◄── one per engine.step()
      └─ TextAssembler per sample: detokenize + stop strings, on the event loop

Detokenization runs on the event loop, inside the consumer of each stream: the engine does nothing per token but
hand over ids once per step, a request whose client went away costs no decoding, and work is spread over the
requests that actually read their output. With the engine in its own process, that work no longer competes with
the step loop for a GIL. (`--engine-in-thread` runs the same core on a thread instead: one process, one GIL.)

The engine process is started when the app starts, so the HTTP port is open and /health reports its startup
phases while weights load. Requests are validated here, with the limits the engine reported once ready, so a bad
prompt gets its 400 before anything is queued.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator

from kestrel.config import EngineConfig
from kestrel.frontend.engine_process import EngineProcess, EngineThread
from kestrel.frontend.first_token import FirstTokenTrace
from kestrel.engine.messages import EngineLimits, EngineStats, TokenLogprob, decode_logprobs, decode_stats
from kestrel.frontend.output import TextAssembler
from kestrel.errors import KestrelError
from kestrel.progress import Progress
from kestrel.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kestrel.models.tokenizer import Tokenizer

logger = logging.getLogger("kestrel.engine")


class EngineNotReady(Exception):
    """The engine is still starting (or failed to start, or died); the server answers 503."""


class EngineOverloaded(Exception):
    """More requests are waiting than --max-queue allows; the server answers 503."""


class EngineFailure(Exception):
    """The engine raised while serving this request; the request fails, the server keeps running."""


@dataclass(slots=True)
class Delta:
    """What one engine step added to one sample of a request, already detokenized."""
    request_id: str
    index: int                          # sample index, 0..n-1
    text: str                           # new text since this sample's previous delta
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None           # set on the sample's last delta: "stop" | "length" | "abort"
    num_prompt_tokens: int
    num_cached_tokens: int
    queue_time_s: float | None          # on a sample's first delta: seconds it waited to be scheduled


def _merged(a: Delta, b: Delta) -> Delta:
    """Two consecutive Deltas of one sample as one (a came first)."""
    logprobs = a.logprobs if b.logprobs is None else b.logprobs if a.logprobs is None else a.logprobs + b.logprobs
    return Delta(a.request_id, a.index, a.text + b.text, a.token_ids + b.token_ids, logprobs, b.finish_reason,
                 b.num_prompt_tokens, b.num_cached_tokens,
                 a.queue_time_s if a.queue_time_s is not None else b.queue_time_s)


_ABORTED = object()    # finishes every open sample of a stream with "abort"


class RequestStream:
    """One request's outputs on the event loop side: a queue of step updates, turned into Deltas on read."""

    def __init__(self, owner: AsyncEngine, request_id: str, params: SamplingParams,
                 trace: FirstTokenTrace | None = None) -> None:
        self.owner = owner
        self.request_id = request_id
        self.params = params
        self.trace = trace                 # stamped by _deliver when this request's first update arrives
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.finished = False
        self.num_waiting_counted = True    # counts against --max-queue until its first token arrives
        self._assemblers = [TextAssembler(owner.tokenizer, params) for _ in range(params.n)]
        self._done = [False] * params.n    # finished, or hit a stop string (later tokens are dropped)
        self._pending: collections.deque[Delta] = collections.deque()
        self._num_prompt_tokens = 0
        self._num_cached_tokens = 0
        self._error: BaseException | None = None

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Delta:
        """The next Delta: everything one sample gained since the reader last asked, in one piece.

        Every step that arrived while the reader was busy (a slow client, a busy event loop) is taken at once and
        merged per sample, so a reader that falls behind catches up in one chunk of several tokens instead of one
        chunk per step: the per-chunk costs (a task wakeup, JSON, an SSE write) stop growing with the step rate.
        """
        while not self._pending:
            if self._error is not None:
                self._close()
                raise self._error
            if all(self._done):
                self._close()
                raise StopAsyncIteration
            self._take(await self.queue.get())
            while not self.queue.empty() and self._error is None:
                self._take(self.queue.get_nowait())
            self._merge_pending()
        return self._pending.popleft()

    def _take(self, item: Any) -> None:
        if isinstance(item, BaseException):
            self._error = item   # raised once the deltas that arrived before it are read
        elif item is _ABORTED:
            self._abort_open_samples()
        else:
            self._absorb(item)

    def _merge_pending(self) -> None:
        """One Delta per sample, in the order the samples first appear (one step's updates keep their order)."""
        if len(self._pending) < 2:
            return
        merged: dict[int, Delta] = {}
        for d in self._pending:
            merged[d.index] = d if d.index not in merged else _merged(merged[d.index], d)
        self._pending = collections.deque(merged.values())

    def _absorb(self, updates: list[tuple]) -> None:
        """Update tuples of one step (engine/messages.py) -> Deltas."""
        self.owner._mark_started(self)
        for _, i, token_ids, logprobs, finished, finish_reason, num_prompt, num_cached, stamps in updates:
            self._num_prompt_tokens, self._num_cached_tokens = num_prompt, num_cached
            queue_time = stamps[1] - stamps[0] if stamps is not None else None
            if self._done[i]:
                continue
            asm = self._assemblers[i]
            text, stop_hit = asm.add(token_ids) if token_ids else ("", False)
            reason = finish_reason if finished else None
            if stop_hit:
                reason = "stop"
                if not finished:
                    self.owner._send(("finish", self.request_id, i))
            if reason is not None:
                self._done[i] = True
                text += asm.flush()    # text held back while it could still start a stop string
            self._pending.append(Delta(self.request_id, i, text, token_ids, decode_logprobs(logprobs), reason,
                                       num_prompt, num_cached, queue_time))

    def _abort_open_samples(self) -> None:
        self.owner._mark_started(self)
        for i, done in enumerate(self._done):
            if not done:
                self._done[i] = True
                self._pending.append(Delta(self.request_id, i, self._assemblers[i].flush(), [], None, "abort",
                                           self._num_prompt_tokens, self._num_cached_tokens, None))

    def _close(self) -> None:
        if not self.finished:
            self.finished = True
            self.owner._forget(self)

    def close(self) -> None:
        """Stop reading; a request that has not finished is aborted and its KV blocks freed.

        Synchronous on purpose: it runs in `finally` blocks of cancelled tasks, where an await would be
        cancelled again before the abort was sent.
        """
        if not self.finished:
            self.finished = True
            self.owner._forget(self)
            self.owner._send(("abort", self.request_id))


class AsyncEngine:
    def __init__(self, config: EngineConfig, progress: Progress, max_queue: int | None = None,
                 in_thread: bool = False) -> None:
        self.config = config
        self.progress = progress
        self.max_queue = max_queue
        self.in_thread = in_thread               # run the core on a thread of this process (one GIL)
        self.startup_error: BaseException | None = None
        self.engine_error: str | None = None     # the engine process died after it was ready
        self.limits: EngineLimits | None = None  # set once the engine is ready
        self._tokenizer: Tokenizer | None = None
        self._host: EngineProcess | EngineThread | None = None
        self._streams: dict[str, RequestStream] = {}   # event-loop side only
        self._num_waiting = 0                          # streams that have not seen their first token
        self._stats: EngineStats | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False

    # ---- lifecycle --------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine process (or thread); call from the event loop that will consume the outputs."""
        self._loop = asyncio.get_running_loop()
        host = EngineThread if self.in_thread else EngineProcess
        self._host = host(self.config, self.progress, self._loop, self._on_event)
        self._host.start()

    @property
    def ready(self) -> bool:
        return self.limits is not None and self.engine_error is None

    @property
    def tokenizer(self) -> Tokenizer:
        self._require()
        return self._tokenizer

    @property
    def max_model_len(self) -> int:
        return self._require().max_model_len

    @property
    def engine_pid(self) -> int | None:
        """The engine process's pid (None in thread mode or before start)."""
        return self._host.pid if self._host is not None else None

    def engine_stacks(self) -> str:
        """The engine process's thread stacks for the stall watchdog ("" in thread mode: they are ours)."""
        return self._host.stacks() if self._host is not None else ""

    def stats(self) -> EngineStats | None:
        """The snapshot taken after the engine's latest step or command batch (None before ready)."""
        return self._stats

    def num_in_flight(self) -> int:
        return len(self._streams)

    @property
    def shutting_down(self) -> bool:
        """SIGTERM arrived: new requests are refused and those in flight aborted."""
        return self._stopping

    def begin_shutdown(self) -> None:
        """Refuse new requests and finish every request in flight with "abort" (SIGTERM)."""
        self._stopping = True
        self.abort_all()

    async def shutdown(self, timeout: float = 5.0) -> None:
        """Abort everything in flight, stop the engine, wait for it up to `timeout` seconds (then terminate it)."""
        self.begin_shutdown()
        if self._host is not None:
            self._host.detach()
            await asyncio.to_thread(self._host.stop, timeout)

    def inject_step_failure(self, message: str) -> None:
        """Test hook: the engine's next forward pass raises RuntimeError(message), like a device fault."""
        self._send(("fail_next_forward", message))

    # ---- requests ---------------------------------------------------------------------------------------------

    async def submit(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                     trace: FirstTokenTrace | None = None) -> RequestStream:
        """Validate a request and hand it to the engine (KestrelError, before anything is queued, if it could
        never run). `trace` gets the request's stamps from here to its first token (shared by several prompts:
        the first one sent, and the first one with a token, stamp it)."""
        limits = self._require()
        if self._stopping:
            raise EngineNotReady("the server is shutting down")
        if request_id in self._streams:
            raise KestrelError(f"request id {request_id!r} is already in flight")
        if self.max_queue is not None and self._num_waiting >= self.max_queue:
            raise EngineOverloaded(f"the request queue is full ({self._num_waiting} requests waiting, "
                                   f"--max-queue {self.max_queue}); retry later")
        limits.check_prompt(prompt_token_ids, params)
        stream = RequestStream(self, request_id, params, trace)
        self._streams[request_id] = stream
        self._num_waiting += 1
        if trace is not None and trace.sent is None:
            # before the write: the engine may take the command before the write returns to this process
            trace.sent = time.monotonic()
        self._send(("add", request_id, list(prompt_token_ids), params))
        return stream

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str) -> AsyncIterator[Delta]:
        """Deltas of every sample until all have finished; closing the iterator early aborts the request."""
        stream = await self.submit(prompt_token_ids, params, request_id)
        try:
            async for delta in stream:
                yield delta
        finally:
            stream.close()

    def abort(self, request_id: str) -> None:
        """Abort a request: its open samples finish with "abort" and its KV blocks are freed."""
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.queue.put_nowait(_ABORTED)
        self._send(("abort", request_id))

    def abort_all(self) -> None:
        for request_id in list(self._streams):
            self.abort(request_id)

    # ---- event-loop side bookkeeping --------------------------------------------------------------------------

    def _require(self) -> EngineLimits:
        if self.engine_error is not None:
            raise EngineNotReady(self.engine_error)
        if self.limits is None:
            if self.startup_error is not None:
                raise EngineNotReady(f"the engine failed to start: {self.startup_error}")
            raise EngineNotReady(f"the model is still starting (phase {self.progress.phase})")
        return self.limits

    def _send(self, command: tuple) -> None:
        if self._host is not None:
            self._host.send(command)

    def _mark_started(self, stream: RequestStream) -> None:
        if stream.num_waiting_counted:
            stream.num_waiting_counted = False
            self._num_waiting -= 1

    def _forget(self, stream: RequestStream) -> None:
        self._mark_started(stream)
        if self._streams.get(stream.request_id) is stream:
            del self._streams[stream.request_id]

    def _on_event(self, event: tuple) -> None:
        """Runs on the event loop: one event of engine/core.py's protocol."""
        kind = event[0]
        if kind == "step":
            self._deliver(event[1], event[2], event[3])
        elif kind == "refused":
            _, request_id, why, message = event
            self._reply(request_id, KestrelError(message) if why == "invalid" else EngineFailure(message))
        elif kind == "failed":
            _, request_ids, message = event
            for request_id in request_ids:
                self._reply(request_id, EngineFailure(message))
        elif kind == "ready":
            _, limits, self._tokenizer, stats = event
            self._stats = decode_stats(stats)
            if self.progress.phase != "ready":
                self.progress.ready()
            self.limits = limits
        elif kind == "start_failed":
            logger.debug("engine startup failed: %s", event[1])   # said once, by the server (server/server.py)
            self.startup_error = KestrelError(event[1])
            self._fail_progress(event[1])
        elif kind == "exited" and not self._stopping:
            self._engine_died(event[1])
        elif kind == "fatal":
            self._engine_died(None, event[1])

    def _deliver(self, updates: list[tuple], stats: tuple | None, emitted: float) -> None:
        """Route one step's update tuples to their streams."""
        if stats is not None:
            self._stats = decode_stats(stats)
        if not updates:
            return
        delivered = time.monotonic()
        by_request: dict[str, list[tuple]] = {}
        for u in updates:
            by_request.setdefault(u[0], []).append(u)
        for request_id, items in by_request.items():
            stream = self._streams.get(request_id)
            if stream is not None:      # None: aborted or closed; its late updates are dropped
                trace = stream.trace
                if trace is not None and trace.delivered is None:
                    _first_token_reached(trace, items, emitted, delivered)
                stream.queue.put_nowait(items)

    def _reply(self, request_id: str, item: Any) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.queue.put_nowait(item)

    def _engine_died(self, exitcode: int | None, why: str | None = None) -> None:
        if self.startup_error is not None or self.engine_error is not None:   # it said why already
            return
        message = why or f"the engine process exited unexpectedly (exit code {exitcode})"
        logger.error("%s; failing %d in-flight request(s)", message, len(self._streams))
        if self.limits is None:
            self.startup_error = EngineNotReady(message)
        self.engine_error = message
        for request_id in list(self._streams):
            self._reply(request_id, EngineFailure(message))
        self._fail_progress(message)

    def _fail_progress(self, message: str) -> None:
        if hasattr(self.progress, "fail"):
            self.progress.fail(message)
        else:
            self.progress.begin("failed")


def _first_token_reached(trace: FirstTokenTrace, updates: list[tuple], emitted: float, delivered: float) -> None:
    """Stamp the engine's side of the trace from the first update that carries a token and its first stamps."""
    for u in updates:
        if u[2] and u[8] is not None:
            trace.engine_reached(u[8], emitted, delivered)
            return
