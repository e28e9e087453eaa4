"""Startup you can watch: /health walks the phases, a stuck phase is reported with every thread's stack, a failed
start stops the server, and SIGTERM ends `kestrel serve` cleanly within 10 s."""
from __future__ import annotations

import pytest

import logging
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import psutil

from kestrel.config import EngineConfig
from kestrel.progress import PHASES
from kestrel.server.app import ServerConfig, build_app
from kestrel.server.server import KestrelServer
from kestrel.server.startup import StartupProgress


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def poll_health(url: str, until, timeout_s: float = 120) -> list[tuple[int, dict]]:
    """GET /health every 20 ms (connection errors skipped) until `until(status, body)`; returns what was seen."""
    seen, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            r = httpx.get(f"{url}/health", timeout=5)
        except httpx.TransportError:
            time.sleep(0.02)
            continue
        seen.append((r.status_code, r.json()))
        if until(*seen[-1]):
            return seen
        time.sleep(0.02)
    raise TimeoutError(f"/health never reached the expected state; last seen {seen[-1:]}")


def test_a_phase_without_progress_is_reported_stalled_with_thread_stacks(caplog):
    progress = StartupProgress(stall_timeout_s=0.2)
    progress.begin("loading_weights", total=100, unit="B")
    progress.start_watchdog()
    try:
        with caplog.at_level(logging.ERROR, logger="kestrel.startup"):
            deadline = time.monotonic() + 10
            while not progress.stalled and time.monotonic() < deadline:
                time.sleep(0.05)
        assert progress.status()["phase"] == "stalled"
        assert progress.status()["stalled_phase"] == "loading_weights"
        dump = "\n".join(r.getMessage() for r in caplog.records)
        assert "loading_weights made no progress" in dump
        assert "test_a_phase_without_progress_is_reported_stalled_with_thread_stacks" in dump   # this thread
        progress.update(50)
        status = progress.status()
        assert status == {"phase": "loading_weights", "progress": 0.5, "elapsed_s": status["elapsed_s"],
                          "phases": status["phases"]}
        assert set(status["phases"]) == {"starting"}   # finished phases only: loading_weights is still running
    finally:
        progress.stop_watchdog()


def start_in_thread(app) -> tuple[KestrelServer, threading.Thread, str]:
    server = KestrelServer(app, log_level="warning")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    return server, thread, f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.mark.slow
def test_a_hung_engine_start_shows_stalled_on_health_with_its_stack_then_recovers(checkpoint_factory, caplog):
    app = build_app(EngineConfig(model=str(checkpoint_factory("llama")), device="cpu"),
                    ServerConfig(stall_timeout_s=0.5))
    # A genuine hang: hold the progress lock, so the server cannot record the engine's first phase report and the
    # real engine process, which waits for each report to be acknowledged, blocks inside build_runner.
    lock = app.state.kestrel.progress._lock
    lock.acquire()
    server, thread, url = start_in_thread(app)
    try:
        with caplog.at_level(logging.ERROR, logger="kestrel.startup"):
            seen = poll_health(url, lambda status, body: body["phase"] == "stalled")
            # The watchdog flips /health to stalled, then writes the stacks: give the log a moment.
            deadline = time.monotonic() + 10
            while "build_runner" not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.05)
        assert all(status == 503 for status, _ in seen)
        assert "build_runner" in caplog.text and "kestrel-engine" in caplog.text   # where the engine hangs
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"
        lock.release()
        seen = poll_health(url, lambda status, body: status == 200)
        assert seen[-1][1]["phase"] == "ready"
    finally:
        if lock.locked():
            lock.release()
        server.request_exit()
        thread.join(timeout=15)


@pytest.mark.slow
def test_a_failed_engine_start_reports_failed_and_stops_the_server(tmp_path):
    app = build_app(EngineConfig(model=str(tmp_path / "missing"), device="cpu"), ServerConfig())
    server, thread, url = start_in_thread(app)
    thread.join(timeout=60)
    assert not thread.is_alive() and server.startup_failed
    status = app.state.kestrel.progress.status()
    assert status["phase"] == "failed" and "does not exist" in status["error"]


@pytest.mark.slow
def test_kestrel_serve_walks_the_phases_and_exits_cleanly_on_sigterm(checkpoint_factory):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "kestrel.cli", "serve", str(checkpoint_factory("llama")),
                             "--device", "cpu", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        seen = poll_health(url, lambda status, body: status == 200)
        assert seen[0][0] == 503, "the port should open before the model is loaded"
        phases = [body["phase"] for _, body in seen]
        assert phases[-1] == "ready" and seen[-1][1]["progress"] == 1.0
        order = ("starting",) + PHASES
        assert all(p in order for p in phases)
        assert [order.index(p) for p in phases] == sorted(order.index(p) for p in phases)
        assert all(status == 503 for status, body in seen if body["phase"] != "ready")
        elapsed = [body["elapsed_s"] for _, body in seen]
        assert elapsed == sorted(elapsed)

        with httpx.stream("POST", f"{url}/v1/completions", timeout=30,
                          json={"prompt": "x", "max_tokens": 250, "ignore_eos": True, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))   # generating now
            engine_processes = psutil.Process(proc.pid).children(recursive=True)
            assert engine_processes, "the engine runs in a child process"
            start = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and '"finish_reason": "abort"' in rest[-2]
        assert proc.wait(timeout=10) == 0
        assert time.monotonic() - start < 10
        _, orphans = psutil.wait_procs(engine_processes, timeout=max(0.0, 10 - (time.monotonic() - start)))
        assert not orphans, "the engine process outlived `kestrel serve`"
    finally:
        if proc.poll() is None:
            proc.kill()
        log = proc.communicate(timeout=10)[0]
    assert "phase: loading weights" in log or "loading_weights" in log
    assert "aborting 1 in flight" in log
