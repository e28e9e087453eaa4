"""The engine core: build the Engine, then apply commands and step while work exists. It runs wherever the device
is owned (the engine process by default, a thread with --engine-in-thread) and speaks only in tuples:

    commands (server -> core)                      events (core -> server), one per step, never per token
    ("add", request_id, prompt_token_ids, params)  ("ready", EngineLimits, model_eos_ids, stats)
    ("abort", request_id)                          ("start_failed", message)
    ("finish", request_id, sample_index)           ("step", [update tuples], stats, emitted)  engine/messages.py
    ("fail_next_forward", message)   tests         ("refused", request_id, "invalid" | "error", message)
    ("stop",)                                      ("failed", [request_ids], message)   a step raised
    ("ack",)                                       ("progress", "begin" | "update", args)  startup, answered by
                                                   an ack (engine process only, see core_host.py)
                                                   ("fatal", message)  a tensor-parallel rank died or hangs:
                                                   the engine cannot go on (the engine process exits after it)

The core blocks on its command channel when idle (no spinning) and drains it without blocking between steps.
Requests are validated by the server before they are sent (EngineLimits), so "refused" is a backstop.
"""
from __future__ import annotations

import logging
import math
import os
import time
from typing import TYPE_CHECKING, Callable, Protocol

from kestrel.config import EngineConfig
from kestrel.engine.messages import SampleUpdate, encode_stats, encode_sample
from kestrel.errors import KestrelError
from kestrel.progress import Progress

if TYPE_CHECKING:
    from kestrel.engine.engine import Engine
    from kestrel.engine.request import Sequence

logger = logging.getLogger("kestrel.engine")

Send = Callable[[tuple], None]


class Commands(Protocol):
    def get(self) -> tuple: ...                   # blocks until a command arrives
    def get_nowait(self) -> tuple | None: ...     # None when none is waiting


class CoreStopped(Exception):
    """A stop command arrived while the engine was still starting."""


def run_engine_core(config: EngineConfig, progress: Progress, commands: Commands, send: Send,
                    exit_on_fatal: bool = False) -> None:
    """exit_on_fatal: after a "fatal" event, end this process (the engine process: its main thread may be stuck in
    a collective with a dead rank; `send` must then be safe to call from another thread)."""
    from kestrel.engine.engine import Engine   # imports torch: here, so the server's port is open while it loads

    def on_rank_failure(message: str) -> None:
        send(("fatal", message))
        if exit_on_fatal:
            os._exit(1)

    try:
        engine = Engine(config, progress=progress, on_rank_failure=on_rank_failure)
    except CoreStopped:
        return
    except KestrelError as exc:    # the user's input (a bad model file, a bad option): the message says it all
        send(("start_failed", str(exc)))
        return
    except BaseException as exc:   # noqa: BLE001 - any startup failure is reported, not raised
        logger.exception("engine startup failed")
        send(("start_failed", f"{type(exc).__name__}: {exc}"))
        return
    send(("ready", engine.limits, tuple(engine.model_config.eos_token_ids), encode_stats(engine.stats())))
    try:
        _step_loop(engine, commands, send)
    finally:
        engine.runner.close()   # tensor parallelism: the other ranks stop with this one


def _step_loop(engine: Engine, commands: Commands, send: Send) -> None:
    live = _LiveRequests()
    while True:
        was_idle = not engine.has_unfinished()
        batch = [] if not was_idle else [commands.get()]   # idle: block, no spin
        while (cmd := commands.get_nowait()) is not None:
            batch.append(cmd)
        for cmd in batch:
            if cmd[0] == "stop":
                for request_id in live.ids():
                    engine.abort_request(request_id)
                return
            _apply(engine, cmd, live, send)
        if not engine.has_unfinished():
            if batch:   # aborts changed the cache: publish fresh stats
                send(("step", [], encode_stats(engine.stats()), time.monotonic()))
            continue
        try:
            updates = engine.step()
        except Exception as exc:   # noqa: BLE001 - fail the requests in flight, keep serving
            logger.exception("engine step failed; failing %d in-flight request(s)", len(live.ids()))
            failed = live.ids()
            for request_id in failed:
                try:
                    engine.abort_request(request_id)
                except Exception:   # noqa: BLE001
                    logger.exception("abort of %s after a failed step also failed", request_id)
            live.clear()
            send(("failed", failed, f"engine error: {type(exc).__name__}: {exc}"))
            send(("step", [], _safe_stats(engine), time.monotonic()))
            continue
        # Stats ride on every step. The radix-tree walk inside them (~1 ms per 1000 cached prompts) is never
        # between a step's tokens and their going out when the engine was or becomes idle, the TTFT of a request
        # at an idle server: coming out of idle, the count taken when it went idle holds but for this step's
        # admissions; going idle, the tokens go out with that count and a fresh one follows at once (it stays on
        # /metrics). While busy it is redone at most every 50 ms.
        busy = engine.has_unfinished()
        stats = engine.stats(max_age_s=0.05 if busy and not was_idle else math.inf)
        send(("step", live.encode(updates), encode_stats(stats), time.monotonic()))
        if not busy:
            send(("step", [], encode_stats(engine.stats()), time.monotonic()))


def _apply(engine: Engine, cmd: tuple, live: _LiveRequests, send: Send) -> None:
    kind = cmd[0]
    if kind == "add":
        _, request_id, prompt_token_ids, params = cmd
        try:
            engine.add_request(request_id, prompt_token_ids, params)
        except KestrelError as exc:
            send(("refused", request_id, "invalid", str(exc)))
            return
        except Exception as exc:   # noqa: BLE001
            logger.exception("add_request(%s) failed", request_id)
            send(("refused", request_id, "error", f"engine error: {exc}"))
            return
        live.add(request_id, engine.sequences(request_id))
    elif kind == "abort":
        if live.discard(cmd[1]):
            engine.abort_request(cmd[1])
    elif kind == "finish":
        if live.sample_done(cmd[1], cmd[2]):
            engine.finish_sample(cmd[1], cmd[2])
    elif kind == "fail_next_forward":
        _fail_next_forward(engine, cmd[1])
    elif kind != "ack":
        raise AssertionError(f"unknown engine command {cmd!r}")


def _fail_next_forward(engine: Engine, message: str) -> None:
    """Test hook: the runner's next step raises, as a device fault would (the real runner, not a mock)."""
    runner = engine.runner
    real_execute = runner.execute

    def failing_execute(chunks):
        runner.execute = real_execute
        raise RuntimeError(message)

    runner.execute = failing_execute


def _safe_stats(engine: Engine) -> tuple | None:
    try:
        return encode_stats(engine.stats())
    except Exception:   # noqa: BLE001
        return None


class _LiveRequests:
    """Core-side bookkeeping: the unfinished samples of each request, and their first stamps once sent."""

    def __init__(self) -> None:
        self._open: dict[str, dict[int, Sequence | None]] = {}   # request id -> sample index -> its Sequence
        self._reported: set[tuple[str, int]] = set()              # samples whose first stamps were sent

    def ids(self) -> list[str]:
        return list(self._open)

    def add(self, request_id: str, seqs: list[Sequence]) -> None:
        self._open[request_id] = {s.index: s for s in seqs}

    def discard(self, request_id: str) -> bool:
        self._reported -= {(request_id, i) for i in self._open.get(request_id, ())}
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

    def encode(self, updates: list[SampleUpdate]) -> list[tuple]:
        """Wire tuples of one step's updates, with each sample's arrival, first-scheduled and first-token stamps
        on its first update; closes finished samples."""
        out = []
        for u in updates:
            key = (u.request_id, u.index)
            seq = self._open.get(u.request_id, {}).get(u.index)
            stamps = None
            if seq is not None and key not in self._reported and seq.first_scheduled_time is not None:
                self._reported.add(key)
                stamps = (seq.arrival_time, seq.first_scheduled_time, seq.first_token_time)
            if u.finished:
                self.sample_done(u.request_id, u.index)
            out.append(encode_sample(u, stamps))
        return out
