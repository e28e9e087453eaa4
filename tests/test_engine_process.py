"""The engine in its own process: the server never imports torch, a dead engine process fails what is in flight
and shows on /health, and `--engine-in-thread` still serves the same tokens."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import httpx
import pytest

from kestrel import LLM, SamplingParams
from kestrel.config import EngineConfig
from kestrel.server.app import ServerConfig
from tests.test_server import PROMPTS, LiveServer


@pytest.fixture(scope="module")
def checkpoint(checkpoint_factory):
    return checkpoint_factory("llama")


@pytest.mark.slow
def test_the_server_side_never_imports_torch():
    code = ("import sys, kestrel.server.app, kestrel.server.cli, kestrel.frontend.engine_process; "
            "assert 'torch' not in sys.modules, 'the server process must not import torch (CUDA lives in the engine)'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_a_dead_engine_process_fails_the_request_in_flight_and_health_reports_it(checkpoint):
    with LiveServer(EngineConfig(model=str(checkpoint), device="cpu")) as server:
        pid = server.engine.engine_pid
        assert pid is not None and pid != os.getpid()
        body = {"prompt": PROMPTS[0], "max_tokens": 250, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))   # generating now
            os.kill(pid, signal.SIGKILL)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2][len("data: "):])["error"]
        assert error["code"] == "engine_error" and "engine process exited unexpectedly" in error["message"]
        health = httpx.get(f"{server.url}/health")
        assert health.status_code == 503
        assert health.json()["phase"] == "failed" and "exit code -9" in health.json()["error"]
        refused = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "not_ready"
        assert server.engine.num_in_flight() == 0


def test_engine_in_thread_mode_serves_the_same_greedy_tokens(checkpoint):
    expected = LLM(model=str(checkpoint), device="cpu").generate(
        PROMPTS, SamplingParams(temperature=0.0, max_tokens=8))
    with LiveServer(EngineConfig(model=str(checkpoint), device="cpu"), ServerConfig(engine_in_thread=True)) as server:
        assert server.engine.engine_pid is None
        for prompt, exp in zip(PROMPTS, expected):
            r = httpx.post(f"{server.url}/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0})
            assert r.json()["choices"][0]["text"] == exp.outputs[0].text
        too_long = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 10_000})
        assert too_long.status_code == 400 and "maximum context length" in too_long.json()["error"]["message"]
