"""First contact over HTTP: out-of-range fields are 400s in OpenAI's format (never 500), the OpenAPI document
describes the POST bodies, and the server logs a line per request and a throughput line while busy.

A real uvicorn on loopback with the real engine (tests/test_server.py's LiveServer), raw httpx and the official
client."""
from __future__ import annotations

import json
import logging
import time

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kestrel.config import EngineConfig
from kestrel.sampling_params import SEED_MAX, SEED_MIN
from kestrel.server.app import ServerConfig
from tests.test_server import LiveServer

SERVER_LOGGER = "kestrel.server"


@pytest.fixture(scope="module")
def checkpoint(checkpoint_factory):
    return checkpoint_factory("llama")


@pytest.fixture(scope="module")
def server(checkpoint):
    # log_stats_interval_s short, so a test sees the throughput line within a second
    config = ServerConfig(log_requests=True, log_stats_interval_s=0.2)
    with LiveServer(EngineConfig(model=str(checkpoint), device="cpu"), config) as s:
        yield s


@pytest.fixture(scope="module")
def quiet_server(checkpoint):
    """--disable-log-requests --disable-log-stats"""
    with LiveServer(EngineConfig(model=str(checkpoint), device="cpu"),
                    ServerConfig(log_requests=False, log_stats_interval_s=None)) as s:
        yield s


@pytest.fixture(scope="module")
def vocab_size(server):
    return server.engine.limits.vocab_size


def post(server, endpoint: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{endpoint}", json=body, timeout=60)


def assert_openai_400(r: httpx.Response, param: str | None) -> None:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param, error


# ---- out-of-range fields: 400, not 500 -----------------------------------------------------------------------------

CHAT = {"messages": [{"role": "user", "content": "hi"}]}

OUT_OF_RANGE = [
    ("completions", {"prompt": "x", "seed": 2**64}, "seed"),
    ("completions", {"prompt": "x", "seed": 2**200}, "seed"),
    ("completions", {"prompt": "x", "seed": SEED_MAX + 1}, "seed"),
    ("completions", {"prompt": "x", "seed": SEED_MIN - 1}, "seed"),
    ("completions", {"prompt": "x", "seed": 2**64 - 1, "n": 2}, "seed"),
    ("completions", {"prompt": "x", "seed": SEED_MAX, "n": 2}, "seed"),     # sample 1 would get SEED_MAX + 1
    ("chat/completions", dict(CHAT, seed=2**64), "seed"),
    ("completions", {"prompt": "x", "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ("chat/completions", dict(CHAT, max_completion_tokens=2, min_tokens=3), "min_tokens"),
    ("chat/completions", dict(CHAT, min_tokens=10**9), "min_tokens"),
    ("completions", {"prompt": "x", "min_tokens": -1}, "min_tokens"),
    ("completions", {"prompt": "x", "stop_token_ids": [10**6]}, "stop_token_ids"),
    ("completions", {"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids"),
    ("completions", {"prompt": "x", "stop_token_ids": [2**70]}, "stop_token_ids"),
    ("chat/completions", dict(CHAT, stop_token_ids=[10**6]), "stop_token_ids"),
    ("completions", {"prompt": "x", "top_k": 2**70}, "top_k"),
    ("completions", {"prompt": "x", "top_k": -2}, "top_k"),
    ("completions", {"prompt": "x", "n": 10**30}, "n"),
    ("completions", {"prompt": "x", "max_tokens": 2**70}, None),
    ("completions", {"prompt": "x", "logprobs": 2**70}, "logprobs"),
    ("completions", {"prompt": [[2**70]]}, None),
    ("chat/completions", dict(CHAT, top_logprobs=2**70, logprobs=True), "top_logprobs"),
]


@pytest.mark.parametrize("endpoint,body,param", OUT_OF_RANGE,
                         ids=[f"{i}-{e}-{sorted(set(b) - {'prompt', 'messages'})}"
                              for i, (e, b, _) in enumerate(OUT_OF_RANGE)])
def test_an_out_of_range_field_is_a_400_naming_it(server, endpoint, body, param):
    assert_openai_400(post(server, endpoint, body), param)


def test_a_stop_token_id_just_outside_the_vocabulary_is_a_400_and_the_last_one_inside_is_fine(server, vocab_size):
    assert_openai_400(post(server, "completions", {"prompt": "x", "stop_token_ids": [vocab_size]}),
                      "stop_token_ids")
    r = post(server, "completions", {"prompt": "x", "max_tokens": 2, "stop_token_ids": [vocab_size - 1]})
    assert r.status_code == 200, r.text


def test_the_largest_seeds_that_fit_are_accepted_and_sample(server):
    for seed, n in ((SEED_MAX, 1), (SEED_MAX - 1, 2), (SEED_MIN, 2), (0, 3)):
        r = post(server, "completions", {"prompt": "x", "max_tokens": 2, "temperature": 1.0, "seed": seed, "n": n})
        assert r.status_code == 200, (seed, n, r.text)
        assert len(r.json()["choices"]) == n


def test_min_tokens_equal_to_max_tokens_is_accepted(server):
    r = post(server, "completions", {"prompt": "x", "max_tokens": 3, "min_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_the_official_client_sees_a_bad_seed_as_a_bad_request(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=server.app.state.kestrel.model_name, prompt="x", seed=2**64 - 1, n=2)
    assert info.value.body["param"] == "seed"


# A small fuzz over real HTTP, the CI part of scripts/fuzz_openapi.sh: any integer in any integer field, any float in
# any float field, never a 5xx. Out-of-range values dominate (the edges are where the 500s were).
INT_FIELDS = ["seed", "n", "max_tokens", "min_tokens", "top_k", "logprobs"]
FLOAT_FIELDS = ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty"]
huge_ints = st.one_of(st.integers(-(2**70), 2**70), st.sampled_from([0, -1, 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64]))
floats = st.one_of(st.floats(allow_nan=False, allow_infinity=False), st.sampled_from([0.0, -0.0, 1e-300, 1e300]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(ints=st.dictionaries(st.sampled_from(INT_FIELDS), huge_ints, max_size=3),
       reals=st.dictionaries(st.sampled_from(FLOAT_FIELDS), floats, max_size=2),
       stop_ids=st.one_of(st.none(), st.lists(huge_ints, max_size=2)),
       chat=st.booleans())
def test_fuzzed_numeric_fields_never_get_a_5xx(server, ints, reals, stop_ids, chat):
    body = {**ints, **reals}
    body.setdefault("max_tokens", 2)   # keep the accepted ones short on the CPU
    if isinstance(body.get("n"), int) and body["n"] > 4:
        body["n"] = body["n"] % 1000   # still out of range above 128, but a 200 stays cheap
    if stop_ids is not None:
        body["stop_token_ids"] = stop_ids
    if chat:
        body["messages"] = CHAT["messages"]
        if "logprobs" in body:
            body["top_logprobs"], body["logprobs"] = body.pop("logprobs"), True
    else:
        body["prompt"] = "x"
    r = post(server, "chat/completions" if chat else "completions", body)
    assert r.status_code < 500, (body, r.text)
    if r.status_code != 200:
        assert_openai_400(r, None)


# ---- the OpenAPI document ------------------------------------------------------------------------------------------

def _resolve(doc: dict, schema: dict) -> dict:
    while "$ref" in schema:
        schema = doc["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    return schema


def test_openapi_describes_the_post_bodies_and_the_error_format(server):
    doc = httpx.get(f"{server.url}/openapi.json").json()
    for path, required in (("/v1/completions", "prompt"), ("/v1/chat/completions", "messages")):
        op = doc["paths"][path]["post"]
        body = _resolve(doc, op["requestBody"]["content"]["application/json"]["schema"])
        assert op["requestBody"]["required"] and required in body["required"]
        assert {"seed", "n", "max_tokens", "min_tokens", "stop_token_ids", "stream"} <= set(body["properties"])
        for status in ("400", "401", "404", "503"):
            error = _resolve(doc, op["responses"][status]["content"]["application/json"]["schema"])
            info = _resolve(doc, error["properties"]["error"])
            assert set(info["properties"]) == {"message", "type", "param", "code"}
        assert "200" in op["responses"]
    assert httpx.get(f"{server.url}/docs").status_code == 200


def test_openapi_and_docs_stay_open_under_an_api_key(checkpoint):
    with LiveServer(EngineConfig(model=str(checkpoint), device="cpu"),
                    ServerConfig(api_key="sekrit", log_stats_interval_s=None)) as s:
        assert httpx.get(f"{s.url}/openapi.json").status_code == 200
        assert httpx.get(f"{s.url}/docs").status_code == 200
        assert httpx.post(f"{s.url}/v1/completions", json={"prompt": "x"}).status_code == 401


# ---- log lines -----------------------------------------------------------------------------------------------------

def _messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == SERVER_LOGGER]


def test_a_finished_request_logs_one_line_with_its_id_tokens_ttft_duration_and_finish_reason(server, caplog):
    caplog.set_level(logging.INFO, logger=SERVER_LOGGER)
    r = post(server, "completions", {"prompt": "def main(", "max_tokens": 5, "temperature": 0, "ignore_eos": True})
    body = r.json()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not any(body["id"] in m for m in _messages(caplog)):
        time.sleep(0.02)
    lines = [m for m in _messages(caplog) if body["id"] in m]
    assert len(lines) == 1, _messages(caplog)
    line = lines[0]
    assert f"prompt {body['usage']['prompt_tokens']} tokens, output 5 tokens" in line
    assert "TTFT " in line and " ms" in line and "duration " in line and line.endswith("finish length")


def test_a_streamed_request_is_logged_too(server, caplog):
    caplog.set_level(logging.INFO, logger=SERVER_LOGGER)
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=60,
                      json=dict(CHAT, max_tokens=3, stream=True, ignore_eos=True)) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    request_id = chunks[0]["id"]
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not any(request_id in m for m in _messages(caplog)):
        time.sleep(0.02)
    assert any(request_id in m and "output 3 tokens" in m for m in _messages(caplog)), _messages(caplog)


def test_a_busy_server_logs_throughput_lines_and_an_idle_one_stays_quiet(server, caplog):
    caplog.set_level(logging.INFO, logger=SERVER_LOGGER)
    post(server, "completions", {"prompt": "x", "max_tokens": 20, "ignore_eos": True, "n": 4})
    deadline = time.monotonic() + 30   # the interval that saw the request ends, and is logged (bounds a hang only)
    while time.monotonic() < deadline and not any("generation 0.0 tok/s" not in m
                                                  for m in _messages(caplog) if "tok/s" in m):
        time.sleep(0.05)
    busy = [m for m in _messages(caplog) if "tok/s" in m]
    assert busy, _messages(caplog)
    assert all(" running " in m and " waiting " in m and "KV cache " in m for m in busy)
    assert any("generation 0.0 tok/s" not in m for m in busy)
    # Idle: some 1 s window (five intervals) logs nothing. On a loaded machine the request's last interval may be
    # logged late, after the first clear; a server that keeps logging while idle never gives a quiet window.
    deadline = time.monotonic() + 30
    while True:
        caplog.clear()
        time.sleep(1.0)
        lines = [m for m in _messages(caplog) if "tok/s" in m]
        if not lines or time.monotonic() > deadline:
            break
    assert lines == []


def test_disable_log_requests_silences_the_request_lines(quiet_server, caplog):
    caplog.set_level(logging.INFO, logger=SERVER_LOGGER)
    r = post(quiet_server, "completions", {"prompt": "x", "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200
    time.sleep(0.3)
    assert not any(m.startswith("request ") for m in _messages(caplog)), _messages(caplog)
    assert not any("tok/s" in m for m in _messages(caplog))
