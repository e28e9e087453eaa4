"""Where the engine core (engine/core.py) runs: its own process (the default) or a thread of the server.

    server process (no torch, no CUDA)                         engine process (spawned; owns the device)
    ──────────────────────────────────                         ─────────────────────────────────────────
    event loop ── send(command) ── commands Pipe ────────────► main thread "kestrel-engine": run_engine_core
                                                                  Engine(config, ForwardedProgress), step loop
    startup reader thread ◄── events Pipe ◄─────────────────── send(event)
      ├─ ("progress", ...) → StartupProgress, then ("ack",) ─► (startup waits for each ack)
      └─ ("ready", ...) → takes the Tokenizer (loading on a thread since start), hands the Pipe to the event loop
    event loop: add_reader(events Pipe) → on_event(("step", ...)), one message per engine step
    stall watchdog ── "stacks" ─── stacks Pipe (duplex) ─────► thread "kestrel-stacks": format_all_stacks()
    EOF on the events Pipe without a stop ──► ("exited", exit code): in-flight requests fail, /health: failed

Why a process: the step loop and the HTTP event loop (detokenization, SSE writes) no longer share one GIL, so
the engine never waits for the server after a device sync. The child is started with "spawn", so CUDA is never
initialised in the server process; it exits on the stop command, or on EOF when the server process is gone.

Once ready, the event loop reads the events Pipe itself (add_reader): no thread hop, and no second thread of
this process asking for the GIL once per step. Startup progress is read on a thread, so that it is recorded even
while the event loop is busy, and acknowledged: the engine waits until the server has recorded each report, so
/health never lags behind the engine, and a server that cannot record (a hang) holds the engine where it is, to
be seen in the stacks the watchdog asks for.
"""
from __future__ import annotations

import asyncio
import logging
import os
import multiprocessing
import queue
import signal
import sys
import threading
from typing import Callable

from kestrel.config import EngineConfig
from kestrel.envs import omp_threads_set
from kestrel.engine.core import CoreStopped, run_engine_core
from kestrel.progress import Progress, format_all_stacks

logger = logging.getLogger("kestrel.engine")

OnEvent = Callable[[tuple], None]   # runs on the event loop


def _post(loop: asyncio.AbstractEventLoop, on_event: OnEvent, event: tuple) -> None:
    """Any thread -> the event loop."""
    try:
        loop.call_soon_threadsafe(on_event, event)
    except RuntimeError:   # the loop is closed: nobody is left to read
        pass


class TokenizerLoad:
    """The server's own tokenizer, loaded on a thread from the moment the engine starts, so that loading it (seconds
    for a large vocabulary) overlaps the engine's startup instead of following it."""

    def __init__(self, config: EngineConfig) -> None:
        from kestrel.models.tokenizer import BackgroundTokenizer

        self.path = config.tokenizer_path
        try:
            self._load: BackgroundTokenizer | Exception = BackgroundTokenizer(self.path)
        except Exception as exc:   # noqa: BLE001 - the engine reports a missing model first; this, if it starts
            self._load = exc

    def with_tokenizer(self, event: tuple) -> tuple:
        """("ready", limits, model_eos_ids, stats) -> ("ready", limits, Tokenizer, stats): the server encodes and
        decodes with its own copy, loaded from the model directory like the engine's. ("start_failed", why) if that
        failed: the server cannot serve without it."""
        _, limits, eos_ids, stats = event
        try:
            if isinstance(self._load, Exception):
                raise self._load
            tokenizer = self._load.result()
        except Exception as exc:   # noqa: BLE001
            logger.error("loading the tokenizer from %s failed: %s", self.path, exc)
            return ("start_failed", f"{type(exc).__name__}: {exc}")
        tokenizer.eos_token_ids |= set(eos_ids)   # the model config's, as the engine's copy has them
        return ("ready", limits, tokenizer, stats)


# ---- engine process ----------------------------------------------------------------------------------------------

class EngineProcess:
    """Server side of the engine process; `on_event` receives every event but progress, on `loop`."""

    def __init__(self, config: EngineConfig, progress: Progress, loop: asyncio.AbstractEventLoop,
                 on_event: OnEvent) -> None:
        self.config = config
        self.progress = progress
        self.loop = loop
        self.on_event = on_event
        self._on_loop = False   # the event loop reads the events Pipe (after ready)
        self.process: multiprocessing.process.BaseProcess | None = None
        self._send_lock = threading.Lock()    # the event loop and the reader (acks) both send commands
        self._stacks_lock = threading.Lock()
        self._reader: threading.Thread | None = None
        self._tokenizer: TokenizerLoad | None = None

    def start(self) -> None:
        self._tokenizer = TokenizerLoad(self.config)
        ctx = multiprocessing.get_context("spawn")
        child_commands, self._commands = ctx.Pipe(duplex=False)   # (receiving end, sending end)
        self._events, child_events = ctx.Pipe(duplex=False)
        self._stacks, child_stacks = ctx.Pipe()
        stall_timeout_s = getattr(self.progress, "stall_timeout_s", None)
        self.process = ctx.Process(target=engine_process_main, name="kestrel-engine", daemon=True,
                                   args=(self.config, child_commands, child_events, child_stacks,
                                         logging.getLogger("kestrel").getEffectiveLevel(), stall_timeout_s))
        self.process.start()
        for end in (child_commands, child_events, child_stacks):   # closed here: EOF once the child is gone
            end.close()
        self._reader = threading.Thread(target=self._read_startup, name="kestrel-engine-reader", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def send(self, command: tuple) -> None:
        try:
            with self._send_lock:
                self._commands.send(command)
        except (OSError, ValueError):   # the engine process is gone: the reader reports it
            pass

    def stacks(self, timeout_s: float = 2.0) -> str:
        """The engine process's thread stacks, for the stall watchdog's log."""
        if self.process is None:
            return ""
        header = f"=== engine process {self.process.name} (pid {self.process.pid}) ===\n"
        with self._stacks_lock:
            try:
                while self._stacks.poll():   # a late answer to an earlier request that timed out
                    self._stacks.recv()
                self._stacks.send("stacks")
                if self._stacks.poll(timeout_s):
                    return header + self._stacks.recv()
            except (OSError, EOFError):
                return header + "(the engine process is gone)"
        return header + f"(no answer within {timeout_s:g} s: the engine process holds its GIL, in native code; " \
                        f"py-spy dump --pid {self.process.pid} shows where)"

    def detach(self) -> None:
        """On the event loop, before stop(): stop reading events (shutting down: nobody waits for them)."""
        if self._on_loop:
            self._on_loop = False
            self.loop.remove_reader(self._events.fileno())

    def stop(self, timeout_s: float) -> None:
        """Blocking: ask the engine to stop, wait, then terminate (and kill) a process that does not exit."""
        if self.process is None:
            return
        self.send(("stop",))
        self.process.join(timeout_s)
        if self.process.is_alive():
            logger.warning("engine process still busy after %.1f s; terminating it", timeout_s)
            self.process.terminate()
            self.process.join(2.0)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(2.0)
        if self._reader is not None:
            self._reader.join(2.0)

    def _read_startup(self) -> None:
        while True:
            try:
                event = self._events.recv()
            except (EOFError, OSError):
                break
            kind = event[0]
            if kind == "progress":
                getattr(self.progress, event[1])(*event[2])
                self.send(("ack",))
                continue
            if kind == "ready":
                event = self._tokenizer.with_tokenizer(event)
                if event[0] == "ready":   # from now on the event loop reads the Pipe
                    _post(self.loop, self._read_on_loop_from_now, event)
                    return
                self.send(("stop",))
            _post(self.loop, self.on_event, event)
        self._report_exit()

    def _read_on_loop_from_now(self, ready: tuple) -> None:
        self._on_loop = True
        self.loop.add_reader(self._events.fileno(), self._read_on_loop)
        self.on_event(ready)

    def _read_on_loop(self) -> None:
        try:
            while self._on_loop and self._events.poll():
                self.on_event(self._events.recv())
        except (EOFError, OSError):
            self.detach()
            threading.Thread(target=self._report_exit, name="kestrel-engine-exit", daemon=True).start()

    def _report_exit(self) -> None:
        self.process.join(5.0)
        _post(self.loop, self.on_event, ("exited", self.process.exitcode))


def engine_process_main(config: EngineConfig, commands, events, stacks, log_level: int,
                        stall_timeout_s: float | None) -> None:
    """The engine process: the core on the main thread, a thread answering stack requests."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C reaches the whole group: the server stops us
    threading.current_thread().name = "kestrel-engine"
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s[engine]: %(message)s",
                        stream=sys.stderr)
    threading.Thread(target=_answer_stack_requests, args=(stacks,), name="kestrel-stacks", daemon=True).start()
    if not omp_threads_set():
        # Leave a core to the server process and this process's pipe threads: intra-op threads on every core
        # spin against them and a CPU model decodes ~3x slower (2 cores: 31 tok/s against 95 with one thread).
        import torch
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) - 1))
    pipe = _PipeCommands(commands)
    send_lock = threading.Lock()   # the main thread and, with tensor parallelism, the rank watch send events

    def send(event: tuple) -> None:
        with send_lock:
            events.send(event)

    try:
        run_engine_core(config, ForwardedProgress(send, pipe, stall_timeout_s), pipe, send, exit_on_fatal=True)
    except (BrokenPipeError, ConnectionResetError):   # the server process is gone
        pass


class _QueueCommands:
    def __init__(self) -> None:
        self.queue: queue.SimpleQueue[tuple] = queue.SimpleQueue()

    def get(self) -> tuple:
        return self.queue.get()

    def get_nowait(self) -> tuple | None:
        try:
            return self.queue.get_nowait()
        except queue.Empty:
            return None


class _PipeCommands(_QueueCommands):
    """The server's commands, taken off the pipe by a thread as they arrive and queued for the core.

    The commands pipe must never fill. If it did, the server's event loop would block writing a command and stop
    reading events, while the engine blocks writing an event and never reads that command: both processes stuck in
    a pipe write (seen with 256 requests submitted at once, ~300 bytes of "add" each against a 64 KiB pipe).
    """

    def __init__(self, conn) -> None:
        super().__init__()
        threading.Thread(target=self._read, args=(conn,), name="kestrel-commands", daemon=True).start()

    def _read(self, conn) -> None:
        while True:
            try:
                command = conn.recv()
            except (EOFError, OSError):   # the server process is gone: stop like a stop command
                self.queue.put(("stop",))
                return
            self.queue.put(command)


def _answer_stack_requests(conn) -> None:
    while True:
        try:
            conn.recv()
            conn.send(format_all_stacks())
        except (EOFError, OSError):
            return


class ForwardedProgress(Progress):
    """Progress inside the engine process: each report goes to the server's StartupProgress (which logs it and
    serves it on /health) and waits for its ack. "ready" is not forwarded: the server declares itself ready once it
    has loaded its tokenizer too."""

    def __init__(self, send: Callable[[tuple], None], commands: _PipeCommands,
                 stall_timeout_s: float | None) -> None:
        super().__init__()
        self._send = send
        self._commands = commands
        self._stall_timeout_s = stall_timeout_s

    def begin(self, phase: str, total: float | None = None, unit: str = "") -> None:
        self.phase, self.total, self.done, self.unit = phase, total, 0.0, unit
        if phase == "ready":
            return
        self._report(("progress", "begin", (phase, total, unit)))

    def update(self, done: float) -> None:
        self.done = done
        self._report(("progress", "update", (done,)))

    def _report(self, event: tuple) -> None:
        # No faulthandler.dump_traceback_later here: its watchdog reads other threads' frames without the GIL
        # and crashed this process (SIGSEGV) when it fired while the stacks thread was formatting frames.
        self._send(event)
        reply = self._commands.get()
        if reply[0] == "stop":
            raise CoreStopped()
        assert reply[0] == "ack", reply


# ---- engine thread (--engine-in-thread) --------------------------------------------------------------------------

class EngineThread:
    """The core on a thread of the server process (the pre-process design: one GIL for both)."""

    def __init__(self, config: EngineConfig, progress: Progress, loop: asyncio.AbstractEventLoop,
                 on_event: OnEvent) -> None:
        self.config = config
        self.progress = progress
        self.loop = loop
        self.on_event = on_event
        self.pid = None
        self._commands = _QueueCommands()
        self._thread: threading.Thread | None = None
        self._tokenizer: TokenizerLoad | None = None

    def start(self) -> None:
        self._tokenizer = TokenizerLoad(self.config)
        self._thread = threading.Thread(target=run_engine_core, name="kestrel-engine", daemon=True,
                                        args=(self.config, self.progress, self._commands, self._emit))
        self._thread.start()

    def send(self, command: tuple) -> None:
        self._commands.queue.put(command)

    def stacks(self, timeout_s: float = 2.0) -> str:
        return ""   # the engine thread is among this process's own stacks

    def detach(self) -> None:
        pass

    def stop(self, timeout_s: float) -> None:
        self.send(("stop",))
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.warning("engine thread still busy after %.1f s; leaving it (daemon thread)", timeout_s)

    def _emit(self, event: tuple) -> None:
        if event[0] == "ready":
            event = self._tokenizer.with_tokenizer(event)
            if event[0] == "start_failed":
                self.send(("stop",))
        _post(self.loop, self.on_event, event)
