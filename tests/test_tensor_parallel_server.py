"""`kestrel serve --tensor-parallel-size 2` on the CPU: the real command on loopback answers the official openai
client with one rank's tokens; a killed rank stops the engine with a message naming it; two "nodes" (two
`kestrel serve` processes meeting at --dist-init-addr) serve like one."""
from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx
import openai
import psutil
import pytest

from kestrel import LLM, SamplingParams
from tests.test_server_startup import free_port, poll_health

pytestmark = pytest.mark.slow   # a server in a subprocess with tensor-parallel ranks

PROMPTS = ["def main(", "import os\nimport"]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def checkpoint(checkpoint_factory):
    return checkpoint_factory("llama")


@pytest.fixture(scope="module")
def expected(checkpoint) -> list[str]:
    llm = LLM(model=str(checkpoint), device="cpu")
    try:
        return [r.outputs[0].text for r in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))]
    finally:
        llm.shutdown()


def serve(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kestrel.cli", "serve", *args, "--device", "cpu"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def stop(proc: subprocess.Popen, timeout_s: float = 30) -> str:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    return out


def worker_pids(proc: subprocess.Popen) -> list[int]:
    return [p.pid for p in psutil.Process(proc.pid).children(recursive=True)
            if "kestrel.ranks.worker" in " ".join(p.cmdline())]


def assert_serves(url: str, expected: list[str]) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    for prompt, text in zip(PROMPTS, expected):
        got = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert got.choices[0].text == text
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert chat.choices[0].finish_reason in ("stop", "length")


def test_serve_at_tp2_answers_the_openai_client_and_a_killed_rank_is_named_within_seconds(checkpoint, expected):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = serve(str(checkpoint), "--tensor-parallel-size", "2", "--port", str(port))
    try:
        seen = poll_health(url, lambda status, body: status == 200)
        assert "starting_ranks" in [body["phase"] for _, body in seen] or len(seen) < 3
        assert_serves(url, expected)

        [worker] = worker_pids(proc)
        psutil.Process(worker).kill()
        start = time.monotonic()
        seen = poll_health(url, lambda status, body: status == 503, timeout_s=10)
        assert time.monotonic() - start < 5
        body = seen[-1][1]
        assert body["phase"] == "failed"
        assert f"tensor-parallel rank 1 (pid {worker}) exited with code -9" in body["error"]
        refused = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert refused.status_code == 503 and "rank 1" in refused.json()["error"]["message"]
        descendants = psutil.Process(proc.pid).children(recursive=True)
    finally:
        out = stop(proc)
    assert "tensor-parallel rank 1" in out
    gone, alive = psutil.wait_procs(descendants, timeout=10)
    assert alive == []


def test_two_nodes_on_loopback_serve_like_one(checkpoint, expected):
    port, dist_port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    common = [str(checkpoint), "--tp", "2", "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{dist_port}"]
    node1 = serve(*common, "--node-rank", "1")
    node0 = serve(*common, "--node-rank", "0", "--port", str(port))
    try:
        poll_health(url, lambda status, body: status == 200)
        assert len(worker_pids(node1)) == 1 and worker_pids(node0) == []   # rank 1 lives on node 1
        assert_serves(url, expected)
    finally:
        out0 = stop(node0)
        out1 = stop(node1)   # rank 0 told rank 1 to stop: node 1 ends on its own
    assert node0.returncode == 0, out0
    assert node1.returncode == 0, out1


def test_a_dead_node_stops_the_server_with_its_rank_named(checkpoint):
    port, dist_port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    common = [str(checkpoint), "--tp", "2", "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{dist_port}"]
    node1 = serve(*common, "--node-rank", "1")
    node0 = serve(*common, "--node-rank", "0", "--port", str(port))
    try:
        poll_health(url, lambda status, body: status == 200)
        [worker] = worker_pids(node1)
        psutil.Process(worker).kill()
        seen = poll_health(url, lambda status, body: status == 503, timeout_s=10)
        assert "node 1: tensor-parallel rank 1" in seen[-1][1]["error"]
        node1.wait(10)
        assert node1.returncode == 1
    finally:
        stop(node0)
        stop(node1)


def test_serve_at_tp2_with_eagle3_answers_like_one_rank_without_it():
    """The default model and its shipped drafter over two ranks: rank 0 drafts, both verify; the openai client gets
    one rank's plain greedy text, and /metrics counts accepted drafts."""
    llm = LLM(device="cpu")
    try:
        expected = [r.outputs[0].text
                    for r in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))]
    finally:
        llm.shutdown()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = serve("--tp", "2", "--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "3",
                 "--speculative-disable-adaptive", "--port", str(port))
    try:
        poll_health(url, lambda status, body: status == 200)
        assert len(worker_pids(proc)) == 1
        assert_serves(url, expected)
        metrics = httpx.get(f"{url}/metrics").text
        accepted = [line for line in metrics.splitlines()
                    if line.startswith("kestrel:spec_decode_num_accepted_tokens_total")]
        assert accepted and float(accepted[0].split()[-1]) > 0, accepted
    finally:
        out = stop(proc)
    assert proc.returncode == 0, out
