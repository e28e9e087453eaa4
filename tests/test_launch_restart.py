"""`kestrel launch --replicas 2 -- kestrel serve` as a user runs it (a subprocess, the real smg router, two real
`kestrel serve` of the default model): a request without `model` is served through the router; SIGKILL one
replica, and the router keeps answering, the launcher restarts the replica on its port, the router routes to it
again, and SIGTERM stops everything with exit 0.

Skipped, with the reason, where smg is not installed or its binary does not run here."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from kestrel.bench.replicas import free_port_block
from tests.test_router_replicas import MODEL, smg_problem
from tests.test_server import metric

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]


class Launch:
    """The launcher as a child process; its stderr collected in a file the test reads as it goes."""

    def __init__(self, tmp_path: Path, port: int, *flags: str) -> None:
        self.err_path = tmp_path / "launch.err"
        serve = [sys.executable, "-m", "kestrel.cli", "serve", "--disable-log-requests", "--disable-log-stats"]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kestrel.cli", "launch", "--replicas", "2", "--port", str(port),
             "--policy", "round_robin", "--log-file", str(tmp_path / "logs" / "x.log"), "--grace", "5",
             "--router-arg=--log-level", "--router-arg=warn", *flags, "--", *serve],
            stdout=subprocess.DEVNULL, stderr=open(self.err_path, "w"), start_new_session=True)

    @property
    def err(self) -> str:
        return self.err_path.read_text()

    def wait_for(self, pattern: str, timeout_s: float) -> re.Match:
        deadline = time.monotonic() + timeout_s
        while not (found := re.search(pattern, self.err)):
            assert self.proc.poll() is None, f"the launcher exited ({self.proc.returncode}):\n{self.err}"
            assert time.monotonic() < deadline, f"no {pattern!r} within {timeout_s} s:\n{self.err}"
            time.sleep(0.2)
        return found

    def stop(self) -> int:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
        return self.proc.wait(timeout=120)


@pytest.fixture
def launch(tmp_path):
    problem = smg_problem()
    if problem:
        pytest.skip(problem)
    base = free_port_block(3)
    running = Launch(tmp_path, base)
    running.router, running.replicas = f"http://127.0.0.1:{base}", [f"http://127.0.0.1:{base + 1 + i}"
                                                                    for i in range(2)]
    try:
        running.wait_for(r"router ready at", timeout_s=300)
        yield running
    finally:
        if running.proc.poll() is None:
            os.killpg(running.proc.pid, signal.SIGTERM)
            running.proc.wait(timeout=120)


def complete(url: str, prompt: str, timeout_s: float, **extra) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2, **extra}, timeout=timeout_s)


def test_a_killed_replica_is_restarted_while_the_router_keeps_answering(launch):
    # first, as against `kestrel serve`: a request that names no model is served (smg alone answers 400)
    done = complete(launch.router, "No model named", timeout_s=60)
    assert done.status_code == 200 and done.json()["model"] == MODEL, done.text
    chat = httpx.post(launch.router + "/v1/chat/completions", timeout=60,
                      json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"], chat.text
    pid = int(launch.wait_for(r"replica 1 \(pid (\d+)\)", 1).group(1))
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    answered = 0
    while time.monotonic() - killed_at < 6:   # every request in the seconds after the kill: answered within 2 s
        started = time.monotonic()
        resp = complete(launch.router, f"After the kill {answered}", timeout_s=2, model=MODEL)
        assert resp.status_code == 200, resp.text
        assert time.monotonic() - started < 2
        answered += 1
    assert answered >= 3
    launch.wait_for(r"replica 1: died \(killed by SIGKILL\).*restart 1 in 1 s", 5)
    launch.wait_for(r"replica 1: back at", timeout_s=180)
    launch.wait_for(r"replica 1: registered with the router again", timeout_s=30)
    assert httpx.get(launch.replicas[1] + "/health", timeout=5).status_code == 200
    # the router routes to it again (round-robin: half of the requests), with no re-registration
    before = metric(launch.replicas[1], "kestrel:prompt_tokens_total")
    for i in range(6):
        assert complete(launch.router, f"Back again {i}", timeout_s=60, model=MODEL).status_code == 200
    assert metric(launch.replicas[1], "kestrel:prompt_tokens_total") > before, launch.err
    assert launch.stop() == 0   # SIGTERM: a clean stop of everything
    err = launch.err
    assert "stopped the router and 2 replica(s)" in err
    assert "HTTP Request:" not in err   # no httpx INFO line per readiness probe
    log = next((launch.err_path.parent / "logs").glob("replica1-*.log")).read_text()
    assert "died (killed by SIGKILL)" in log and "restart 1 (pid" in log   # one log per replica, restarts noted
