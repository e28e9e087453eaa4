"""Replicas behind a proven router: two real `kestrel serve` processes (the default model) behind smg, the
Shepherd Model Gateway (PyPI `smg`, a Rust binary), on loopback, driven through the official `openai` client.

Skipped, with the reason, where smg is not installed or its binary does not run here."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
import threading
import time

import httpx
import openai
import pytest

from kestrel.bench.launch import LaunchExit
from kestrel.bench.replicas import ReplicaConfig, ReplicaSet, free_port_block, router_healthy_workers
from tests.test_server import metric

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

MODEL = "kestrel-tiny"


def smg_problem() -> str | None:
    """Why smg cannot be used here (None: it can)."""
    if importlib.util.find_spec("smg") is None:
        return "smg is not installed (pip install smg==1.13.0, pinned in requirements/test.txt)"
    try:
        res = subprocess.run([sys.executable, "-m", "smg", "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"smg does not run here: {exc}"
    if res.returncode != 0:   # e.g. a glibc older than its manylinux_2_17 wheel needs
        return f"smg does not run here: {(res.stderr or res.stdout).strip()[-300:]}"
    return None




@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    problem = smg_problem()
    if problem:
        pytest.skip(problem)
    base = free_port_block(3)
    cfg = ReplicaConfig(
        serve_command=(sys.executable, "-m", "kestrel.cli", "serve", "--disable-log-requests",
                       "--disable-log-stats"),
        replicas=2, replica_port=base + 1, router="smg", router_port=base, policy="round_robin",
        router_args=("--health-check-interval-secs", "1", "--load-monitor-interval", "1",
                     "--health-failure-threshold", "1", "--health-success-threshold", "1", "--log-level", "warn"),
        log_dir=str(tmp_path_factory.mktemp("logs")), ready_timeout_s=300, grace_s=10)
    with ReplicaSet(cfg) as replica_set:
        yield replica_set


def client(replica_set: ReplicaSet, retries: int = 0) -> openai.OpenAI:
    return openai.OpenAI(base_url=replica_set.url + "/v1", api_key="none", max_retries=retries, timeout=120)


def prompt_tokens(url: str) -> float:
    return metric(url, "kestrel:prompt_tokens_total")


def test_completions_and_streamed_chat_through_the_router_reach_both_replicas(replicas):
    before = [prompt_tokens(url) for url in replicas.cfg.replica_urls]
    api = client(replicas)
    for i in range(4):
        done = api.completions.create(model=MODEL, prompt=f"Once upon a time, number {i},", max_tokens=6)
        assert done.choices[0].text and done.choices[0].finish_reason == "length"
    for i in range(4):
        stream = api.chat.completions.create(model=MODEL, stream=True, max_tokens=6,
                                             messages=[{"role": "user", "content": f"Tell me a story {i}."}])
        text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        assert text
    after = [prompt_tokens(url) for url in replicas.cfg.replica_urls]
    assert all(a > b for a, b in zip(after, before)), f"prompt tokens per replica {before} -> {after}"


def test_the_router_reads_each_replicas_model_and_load(replicas):
    workers = httpx.get(replicas.url + "/workers", timeout=10).json()["workers"]
    assert sorted(w["url"] for w in workers) == replicas.cfg.replica_urls
    assert all(w["model_id"] == MODEL and w["is_healthy"] for w in workers)
    deadline = time.monotonic() + 20   # the load monitor polls every second
    while True:
        loads = httpx.get(replicas.url + "/get_loads", timeout=10).json()["loads"]
        by_worker = {entry["worker"]: entry for entry in loads}
        if sorted(by_worker) == replicas.cfg.replica_urls or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert sorted(by_worker) == replicas.cfg.replica_urls, loads
    for url, entry in by_worker.items():   # what the replica's own /v1/loads says, parsed by the router
        own = httpx.get(url + "/v1/loads", timeout=10).json()["loads"][0]
        assert entry["max_total_num_tokens"] == own["max_total_num_tokens"] > 0
        assert entry["max_running_requests"] == own["max_running_requests"]


def test_the_benchmark_finds_the_replicas_tokenizer_through_the_router(replicas):
    """smg answers /v1/models itself (no `root`) but forwards /get_model_info: the bench's tokenizer path."""
    from kestrel.bench.server_info import model_root, server_info
    from kestrel.config import DEFAULT_MODEL_DIR

    info = server_info(replicas.url)
    assert not (info["models"]["data"][0].get("root"))
    assert Path(model_root(info)).resolve() == DEFAULT_MODEL_DIR.resolve()


class Traffic:
    """Completions through the router, one after another on a thread, until stopped; every outcome kept."""

    def __init__(self, replica_set: ReplicaSet) -> None:
        self.api = client(replica_set)   # no client retries: only the router's may hide a failure
        self.ok = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            i += 1
            try:
                done = self.api.completions.create(model=MODEL, prompt=f"Request {i}: the weather", max_tokens=4)
                if done.choices[0].finish_reason in ("length", "stop"):
                    self.ok += 1
                else:
                    self.failures.append(f"request {i}: finish_reason {done.choices[0].finish_reason}")
            except openai.OpenAIError as exc:
                self.failures.append(f"request {i}: {type(exc).__name__}: {exc}")

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=180)


def wait_healthy(replica_set: ReplicaSet, n: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while router_healthy_workers(replica_set.url) != n:
        assert time.monotonic() < deadline, f"the router never counted {n} healthy replica(s)"
        time.sleep(0.2)


def test_a_stopped_replica_leaves_the_routers_view_and_returns_with_no_request_lost(replicas):
    with Traffic(replicas) as traffic:
        time.sleep(2)
        replicas.stop_replica(1)
        wait_healthy(replicas, 1, timeout_s=30)
        served_while_down = traffic.ok
        time.sleep(3)
        assert replicas.restart_replica(1) is LaunchExit.READY
        wait_healthy(replicas, 2, timeout_s=60)
        time.sleep(2)
    assert not traffic.failures, traffic.failures
    assert traffic.ok > served_while_down > 0
    # back in rotation: it takes requests again
    before = prompt_tokens(replicas.cfg.replica_urls[1])
    api = client(replicas)
    for i in range(4):
        api.completions.create(model=MODEL, prompt=f"After the restart {i}", max_tokens=2)
    assert prompt_tokens(replicas.cfg.replica_urls[1]) > before
