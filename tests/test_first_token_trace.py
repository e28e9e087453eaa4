"""Where time to first token goes: each request's stages (frontend/first_token.py) on /metrics as
kestrel:first_token_stage_seconds{stage}, every one present and non-negative, and together no longer than the TTFT
the client saw. A real uvicorn on loopback with the real engine in its own process (tests/test_server.py's
LiveServer); no timed thresholds."""
from __future__ import annotations

import json
import random
import time

import httpx
import pytest

from kestrel.config import EngineConfig
from kestrel.frontend.first_token import STAGE_NAMES, STAGES, FirstTokenTrace
from tests.test_server import LiveServer, metric

STAGE_METRIC = "kestrel:first_token_stage_seconds"


@pytest.fixture(scope="module")
def server(checkpoint_factory):
    with LiveServer(EngineConfig(model=str(checkpoint_factory("llama")), device="cpu")) as s:
        yield s


def stage_totals(url: str) -> dict[str, tuple[float, float]]:
    """stage -> (count, sum of seconds) so far."""
    return {name: (metric(url, f"{STAGE_METRIC}_count", stage=name), metric(url, f"{STAGE_METRIC}_sum", stage=name))
            for name in STAGE_NAMES}


def stages_of_next_request(url: str, send) -> tuple[dict[str, float], float]:
    """Each stage's seconds for the one request `send()` makes (the difference of /metrics around it), and what
    `send()` returned."""
    before = stage_totals(url)
    result = send()
    after = stage_totals(url)
    seconds = {}
    for name in STAGE_NAMES:
        count = after[name][0] - before[name][0]
        if count:
            assert count == 1, (name, count)
            seconds[name] = after[name][1] - before[name][1]
    return seconds, result


def fresh_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 200) for _ in range(n)]


def streamed_ttft(url: str, path: str, body: dict, has_text) -> float:
    """Seconds from sending to the first SSE chunk with text (or the finish, for a sample whose tokens are all
    text-less: a random model's), on time.monotonic (the server's clock too)."""
    start = time.monotonic()
    with httpx.stream("POST", f"{url}{path}", json=dict(body, stream=True), timeout=60) as r:
        assert r.status_code == 200, r.read()
        ttft = None
        for line in r.iter_lines():   # to the end: the request finishes before the next one starts
            if ttft is None and line.startswith("data: ") and line != "data: [DONE]" \
                    and has_text(json.loads(line[6:])):
                ttft = time.monotonic() - start
    assert ttft is not None, "the stream carried no text"
    return ttft


def completion_text(chunk: dict) -> bool:
    return bool(chunk["choices"]) and bool(chunk["choices"][0]["text"] or chunk["choices"][0]["finish_reason"])


def chat_text(chunk: dict) -> bool:
    choice = chunk["choices"][0] if chunk["choices"] else None
    return choice is not None and bool(choice["delta"].get("content") or choice["finish_reason"])


def test_streamed_completion_stages_are_non_negative_and_fit_in_the_client_ttft(server):
    rng = random.Random(1)
    for _ in range(3):
        body = {"prompt": fresh_prompt(rng, 48), "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        stages, ttft = stages_of_next_request(server.url, lambda: streamed_ttft(
            server.url, "/v1/completions", body, completion_text))
        assert set(stages) == set(STAGE_NAMES), stages
        assert all(s >= 0 for s in stages.values()), stages
        # The stages are consecutive intervals inside the client's window on the same clock; 1 ms for rounding.
        assert sum(stages.values()) <= ttft + 1e-3, (stages, ttft)
        assert stages["prefill"] > 0   # the forward pass is in there somewhere


def test_streamed_chat_stages_end_at_the_first_text_not_the_role_chunk(server):
    body = {"messages": [{"role": "user", "content": "tell me about kestrels"}], "max_tokens": 4,
            "temperature": 0, "ignore_eos": True}
    stages, ttft = stages_of_next_request(server.url, lambda: streamed_ttft(
        server.url, "/v1/chat/completions", body, chat_text))
    assert set(stages) == set(STAGE_NAMES) and all(s >= 0 for s in stages.values()), stages
    assert sum(stages.values()) <= ttft + 1e-3, (stages, ttft)


def test_non_streamed_request_has_every_stage_but_the_sse_write(server):
    body = {"prompt": fresh_prompt(random.Random(2), 16), "max_tokens": 2, "temperature": 0}

    def send() -> float:
        start = time.monotonic()
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return time.monotonic() - start

    stages, e2e = stages_of_next_request(server.url, send)
    assert set(stages) == set(STAGE_NAMES) - {"sse_write"}, stages
    assert all(s >= 0 for s in stages.values()) and sum(stages.values()) <= e2e + 1e-3


def test_refused_request_observes_no_stages(server):
    stages, status = stages_of_next_request(server.url, lambda: httpx.post(
        f"{server.url}/v1/completions", json={"prompt": [10**9], "max_tokens": 2}, timeout=60).status_code)
    assert status == 400 and stages == {}


def test_stages_are_consecutive_and_add_up_to_received_to_written():
    stamps = [10.0 + 0.001 * i for i in range(len(STAGES) + 1)]
    names = ["received"] + [end for _, _, end in STAGES]
    assert [start for _, start, _ in STAGES] == names[:-1]   # each stage starts where the one before ended
    trace = FirstTokenTrace(stamps[0])
    for name, t in zip(names[1:], stamps[1:]):
        setattr(trace, name, t)
    assert sum(trace.stages().values()) == pytest.approx(trace.written - trace.received)
    assert FirstTokenTrace(1.0, parsed=1.5).stages() == {"http_parse": 0.5}


def test_the_breakdown_script_reports_median_stages_of_fresh_prompts(server):
    from benchmarks.ttft_breakdown import measure, table

    r = measure(server.url, prompt_len=24, requests=5, warmup=1, max_tokens=2, seed=3)
    assert len(r["runs"]) == 5 and set(r["stages_ms_p50"]) == set(STAGE_NAMES)
    for run in r["runs"]:
        assert all(ms >= 0 for ms in run["stages_ms"].values())
        assert run["server_ttft_ms"] <= run["client_ttft_ms"] + 1.0
    assert "prefill" in table(r) and "client TTFT" in table(r)
