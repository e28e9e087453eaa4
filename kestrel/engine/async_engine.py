"""AsyncEngine: the synchronous Engine on its own thread, with an asyncio front door.

    event loop (HTTP handlers)                          engine thread (owns the device)
    ─────────────────────────                           ──────────────────────────────
    submit() ── Add ──────────► commands (queue.Queue) ──► engine.add_request
    abort()  ── Abort ────────►                         ──► engine.abort_request
    stop string ─ FinishSample►                         ──► engine.finish_sample
                                                           loop: engine.step() while work exists,
                                                                 block on the queue when idle
    RequestStream.queue ◄── call_soon_threadsafe(updates of one step, stats) ◄──┘
      └─ TextAssembler per sample: detokenize + stop strings, on the event loop

Detokenization runs on the event loop, inside the consumer of each stream, not on the engine thread: the step loop
then does nothing per token but hand over ids, a request whose client went away costs no decoding, and work is
spread over the requests that actually read their output. (A worker thread would add a hop and GIL contention
without taking load off the step thread.)

The Engine is constructed on the engine thread too, so the HTTP port is open and /health reports its startup
phases while weights load.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator

from kestrel.config import EngineConfig
from kestrel.engine.output import TextAssembler
from kestrel.errors import KestrelError
from kestrel.progress import Progress
from kestrel.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kestrel.engine.engine import Engine, EngineStats, SampleUpdate
    from kestrel.engine.request import Sequence, TokenLogprob

logger = logging.getLogger("kestrel.engine")


class EngineNotReady(Exception):
    """The engine is still starting (or failed to start); the server answers 503."""


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


# ---- commands: event loop -> engine thread ---------------------------------------------------------------------

@dataclass(slots=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _FinishSample:
    request_id: str
    index: int


@dataclass(slots=True)
class _Stop:
    pass


_ACCEPTED = object()   # first item of a stream once engine.add_request succeeded
_ABORTED = object()    # finishes every open sample of a stream with "abort"


class RequestStream:
    """One request's outputs on the event loop side: a queue of step updates, turned into Deltas on read."""

    def __init__(self, owner: AsyncEngine, request_id: str, params: SamplingParams) -> None:
        self.owner = owner
        self.request_id = request_id
        self.params = params
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.finished = False
        self.num_waiting_counted = True    # counts against --max-queue until its first token arrives
        self._assemblers = [TextAssembler(owner.tokenizer, params) for _ in range(params.n)]
        self._done = [False] * params.n    # finished, or hit a stop string (later tokens are dropped)
        self._pending: collections.deque[Delta] = collections.deque()
        self._num_prompt_tokens = 0
        self._num_cached_tokens = 0

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Delta:
        while not self._pending:
            if all(self._done):
                self._close()
                raise StopAsyncIteration
            item = await self.queue.get()
            if isinstance(item, BaseException):
                self._close()
                raise item
            if item is _ACCEPTED:
                continue
            if item is _ABORTED:
                self._abort_open_samples()
            else:
                self._absorb(*item)
        return self._pending.popleft()

    def _absorb(self, updates: list[SampleUpdate], queue_times: dict[tuple[str, int], float]) -> None:
        self.owner._mark_started(self)
        for u in updates:
            self._num_prompt_tokens, self._num_cached_tokens = u.num_prompt_tokens, u.num_cached_tokens
            i = u.index
            if self._done[i]:
                continue
            asm = self._assemblers[i]
            text, stop_hit = asm.add(u.new_token_ids) if u.new_token_ids else ("", False)
            reason = u.finish_reason if u.finished else None
            if stop_hit:
                reason = "stop"
                if not u.finished:
                    self.owner._send(_FinishSample(self.request_id, i))
            if reason is not None:
                self._done[i] = True
                text += asm.flush()    # text held back while it could still start a stop string
            self._pending.append(Delta(self.request_id, i, text, list(u.new_token_ids), u.new_logprobs, reason,
                                       u.num_prompt_tokens, u.num_cached_tokens,
                                       queue_times.get((self.request_id, i))))

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
            self.owner._send(_Abort(self.request_id))


class AsyncEngine:
    def __init__(self, config: EngineConfig, progress: Progress, max_queue: int | None = None) -> None:
        self.config = config
        self.progress = progress
        self.max_queue = max_queue
        self.engine: Engine | None = None          # set on the engine thread once constructed
        self.startup_error: BaseException | None = None
        self._commands: queue.Queue[Any] = queue.Queue()
        self._streams: dict[str, RequestStream] = {}   # event-loop side only
        self._num_waiting = 0                          # streams that have not seen their first token
        self._stats: EngineStats | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stopping = False

    # ---- lifecycle --------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread; call from the event loop that will consume the outputs."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kestrel-engine", daemon=True)
        self._thread.start()

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self.engine is not None

    @property
    def tokenizer(self):
        return self._require().tokenizer

    @property
    def max_model_len(self) -> int:
        return self._require().max_model_len

    def stats(self) -> EngineStats | None:
        """The snapshot taken after the engine's latest step or command batch (None before ready)."""
        return self._stats

    def num_in_flight(self) -> int:
        return len(self._streams)

    def begin_shutdown(self) -> None:
        """Refuse new requests and finish every request in flight with "abort" (SIGTERM)."""
        self._stopping = True
        self.abort_all()

    async def shutdown(self, timeout: float = 5.0) -> None:
        """Abort everything in flight, stop the engine thread, wait for it up to `timeout` seconds."""
        self.begin_shutdown()
        self._send(_Stop())
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout)
            if self._thread.is_alive():
                logger.warning("engine thread still busy after %.1f s; leaving it (daemon thread)", timeout)

    # ---- requests ---------------------------------------------------------------------------------------------

    async def submit(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str) -> RequestStream:
        """Hand a request to the engine; returns once the engine accepted it (KestrelError if it refused)."""
        self._require()
        if self._stopping:
            raise EngineNotReady("the server is shutting down")
        if request_id in self._streams:
            raise KestrelError(f"request id {request_id!r} is already in flight")
        if self.max_queue is not None and self._num_waiting >= self.max_queue:
            raise EngineOverloaded(f"the request queue is full ({self._num_waiting} requests waiting, "
                                   f"--max-queue {self.max_queue}); retry later")
        stream = RequestStream(self, request_id, params)
        self._streams[request_id] = stream
        self._num_waiting += 1
        self._send(_Add(request_id, list(prompt_token_ids), params))
        try:
            first = await stream.queue.get()
        except BaseException:
            stream.close()             # cancelled while waiting: the engine may have it already
            raise
        if first is _ABORTED:           # aborted before the engine answered; its abort follows the add
            stream.queue.put_nowait(_ABORTED)
        elif first is not _ACCEPTED:
            stream._close()
            raise first
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
        self._send(_Abort(request_id))

    def abort_all(self) -> None:
        for request_id in list(self._streams):
            self.abort(request_id)

    # ---- event-loop side bookkeeping --------------------------------------------------------------------------

    def _require(self) -> Engine:
        if self.engine is None or not self._ready.is_set():
            phase = self.progress.phase
            if self.startup_error is not None:
                raise EngineNotReady(f"the engine failed to start: {self.startup_error}")
            raise EngineNotReady(f"the model is still starting (phase {phase})")
        return self.engine

    def _send(self, command: Any) -> None:
        self._commands.put(command)

    def _mark_started(self, stream: RequestStream) -> None:
        if stream.num_waiting_counted:
            stream.num_waiting_counted = False
            self._num_waiting -= 1

    def _forget(self, stream: RequestStream) -> None:
        self._mark_started(stream)
        if self._streams.get(stream.request_id) is stream:
            del self._streams[stream.request_id]

    def _deliver(self, updates: list[SampleUpdate], stats: EngineStats | None,
                 queue_times: dict[tuple[str, int], float] | None = None) -> None:
        """Runs on the event loop: route one step's updates to their streams."""
        if stats is not None:
            self._stats = stats
        by_request: dict[str, list[SampleUpdate]] = {}
        for u in updates:
            by_request.setdefault(u.request_id, []).append(u)
        for request_id, items in by_request.items():
            stream = self._streams.get(request_id)
            if stream is not None:      # None: aborted or closed; its late updates are dropped
                stream.queue.put_nowait((items, queue_times or {}))

    def _reply(self, request_id: str, item: Any) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.queue.put_nowait(item)

    def _post(self, callback, *args) -> None:
        """Engine thread -> event loop."""
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:   # the loop is closed: nobody is left to read
            pass

    # ---- engine thread ----------------------------------------------------------------------------------------

    def _run(self) -> None:
        from kestrel.engine.engine import Engine   # imports torch: here, so the port is open while it loads

        try:
            engine = Engine(self.config, progress=self.progress)
        except BaseException as exc:   # noqa: BLE001 - any startup failure is reported, not raised into a thread
            logger.exception("engine startup failed")
            self.startup_error = exc
            if hasattr(self.progress, "fail"):
                self.progress.fail(f"{type(exc).__name__}: {exc}")
            else:
                self.progress.begin("failed")
            return
        self.engine = engine
        self._stats = engine.stats()
        if self.progress.phase != "ready":
            self.progress.ready()
        self._ready.set()
        self._step_loop(engine)

    def _step_loop(self, engine: Engine) -> None:
        live = _LiveRequests()
        while True:
            commands = [self._commands.get()] if not engine.has_unfinished() else []   # idle: block, no spin
            while True:
                try:
                    commands.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            for cmd in commands:
                if isinstance(cmd, _Stop):
                    for request_id in live.ids():
                        engine.abort_request(request_id)
                    return
                self._apply(engine, cmd, live)
            if not engine.has_unfinished():
                if commands:   # aborts changed the cache: publish fresh stats
                    self._post(self._deliver, [], engine.stats())
                continue
            try:
                updates = engine.step()
            except Exception as exc:   # noqa: BLE001 - fail the requests in flight, keep serving
                logger.exception("engine step failed; failing %d in-flight request(s)", len(live.ids()))
                failure = EngineFailure(f"engine error: {type(exc).__name__}: {exc}")
                for request_id in live.ids():
                    try:
                        engine.abort_request(request_id)
                    except Exception:   # noqa: BLE001
                        logger.exception("abort of %s after a failed step also failed", request_id)
                    self._post(self._reply, request_id, failure)
                live.clear()
                self._post(self._deliver, [], self._safe_stats(engine))
                continue
            self._post(self._deliver, updates, engine.stats(), live.absorb(updates))

    def _apply(self, engine: Engine, cmd: Any, live: _LiveRequests) -> None:
        if isinstance(cmd, _Add):
            try:
                engine.add_request(cmd.request_id, cmd.prompt_token_ids, cmd.params)
            except KestrelError as exc:
                self._post(self._reply, cmd.request_id, exc)
                return
            except Exception as exc:   # noqa: BLE001
                logger.exception("add_request(%s) failed", cmd.request_id)
                self._post(self._reply, cmd.request_id, EngineFailure(f"engine error: {exc}"))
                return
            live.add(cmd.request_id, engine.sequences(cmd.request_id))
            self._post(self._reply, cmd.request_id, _ACCEPTED)
        elif isinstance(cmd, _Abort):
            if live.discard(cmd.request_id):
                engine.abort_request(cmd.request_id)
        elif isinstance(cmd, _FinishSample):
            if live.sample_done(cmd.request_id, cmd.index):
                engine.finish_sample(cmd.request_id, cmd.index)

    @staticmethod
    def _safe_stats(engine: Engine) -> EngineStats | None:
        try:
            return engine.stats()
        except Exception:   # noqa: BLE001
            return None


class _LiveRequests:
    """Engine-thread bookkeeping: the unfinished samples of each request, and their queue time once scheduled."""

    def __init__(self) -> None:
        self._open: dict[str, dict[int, Sequence | None]] = {}   # request id -> sample index -> its Sequence
        self._reported: set[tuple[str, int]] = set()              # samples whose queue time was sent

    def ids(self) -> list[str]:
        return list(self._open)

    def add(self, request_id: str, seqs: list[Sequence]) -> None:
        self._open[request_id] = {s.index: s for s in seqs}

    def discard(self, request_id: str) -> bool:
        self._reported.difference_update({(request_id, i) for i in self._open.get(request_id, ())})
        return self._open.pop(request_id, None) is not None

    def clear(self) -> None:
        self._open.clear()
        self._reported.clear()

    def sample_done(self, request_id: str, index: int) -> bool:
        """Mark a sample finished; False when it already was (or the request is unknown)."""
        samples = self._open.get(request_id)
        if samples is None or index not in samples:
            return False
        del samples[index]
        self._reported.discard((request_id, index))
        if not samples:
            del self._open[request_id]
        return True

    def absorb(self, updates: list[SampleUpdate]) -> dict[tuple[str, int], float]:
        """Close finished samples; return the queue time of samples seen for the first time."""
        queue_times = {}
        for u in updates:
            key = (u.request_id, u.index)
            seq = self._open.get(u.request_id, {}).get(u.index)
            if seq is not None and key not in self._reported and seq.first_scheduled_time is not None:
                self._reported.add(key)
                queue_times[key] = seq.first_scheduled_time - seq.arrival_time
            if u.finished:
                self.sample_done(u.request_id, u.index)
        return queue_times
