"""No open doors (issue 53): what a web page, an oversized body or a caller without the key can do to a server.
A real uvicorn on loopback (tests/test_server.py's LiveServer), raw HTTP through httpx."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from kestrel.config import EngineConfig
from kestrel.server.app import ServerConfig
from tests.test_server import LiveServer


@pytest.fixture(scope="module")
def checkpoint(checkpoint_factory):
    return checkpoint_factory("llama")


@pytest.fixture(scope="module")
def server(checkpoint):
    with LiveServer(EngineConfig(model=str(checkpoint), device="cpu")) as s:
        yield s


def assert_openai_error(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    if code is not None:
        assert error["code"] == code
    return error


BODIES = {"completions": b'{"prompt": "def main(", "max_tokens": 2}',
          "chat/completions": b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'}


@pytest.mark.parametrize("endpoint", sorted(BODIES))
@pytest.mark.parametrize("content_type", ["text/plain", "text/plain;charset=UTF-8",
                                          "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                                          None])
def test_a_body_that_is_not_declared_json_is_a_415(server, endpoint, content_type):
    """What a web page can send without a CORS preflight never starts a generation."""
    headers = {"content-type": content_type} if content_type else {}
    r = httpx.post(f"{server.url}/v1/{endpoint}", content=BODIES[endpoint], headers=headers, timeout=30)
    error = assert_openai_error(r, 415, "unsupported_media_type")
    assert "application/json" in error["message"]


@pytest.mark.parametrize("endpoint", sorted(BODIES))
@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8",
                                          "Application/JSON"])
def test_json_bodies_are_served(server, endpoint, content_type):
    r = httpx.post(f"{server.url}/v1/{endpoint}", content=BODIES[endpoint], headers={"content-type": content_type},
                   timeout=60)
    assert r.status_code == 200, r.text


# ---- body size (413) and no tokenizing on the event loop ---------------------------------------------------------

LIMIT = 1024 * 1024


@pytest.fixture(scope="module")
def small_body_server(checkpoint):
    with LiveServer(EngineConfig(model=str(checkpoint), device="cpu"),
                    ServerConfig(max_request_body_bytes=LIMIT)) as s:
        yield s


def oversized_completion() -> bytes:
    body = json.dumps({"prompt": "x " * LIMIT, "max_tokens": 2}).encode()
    assert len(body) > LIMIT
    return body


class HealthProbe:
    """Polls /health on a thread while the test sends something heavy; the slowest answer it saw."""

    def __init__(self, url: str) -> None:
        self.url, self.slowest, self.answers = url, 0.0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set():
                start = time.monotonic()
                self.answers.append(client.get(f"{self.url}/health").status_code)
                self.slowest = max(self.slowest, time.monotonic() - start)
                time.sleep(0.01)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.answers and time.monotonic() < deadline:   # polling before the heavy request goes out
            time.sleep(0.005)
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_a_body_over_the_limit_is_a_413_from_its_content_length(small_body_server, endpoint):
    with HealthProbe(small_body_server.url) as probe:
        r = httpx.post(f"{small_body_server.url}/v1/{endpoint}", content=oversized_completion(),
                       headers={"content-type": "application/json"}, timeout=30)
    error = assert_openai_error(r, 413, "request_too_large")
    assert str(LIMIT) in error["message"] and "--max-request-body-bytes" in error["message"]
    assert probe.answers and set(probe.answers) == {200}


def test_a_chunked_body_over_the_limit_is_a_413_as_it_grows(small_body_server):
    body = oversized_completion()

    def chunks():   # no Content-Length: Transfer-Encoding: chunked
        for i in range(0, len(body), 64 * 1024):
            yield body[i:i + 64 * 1024]

    r = httpx.post(f"{small_body_server.url}/v1/completions", content=chunks(),
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.request.headers.get("transfer-encoding") == "chunked"
    assert_openai_error(r, 413, "request_too_large")
    # a chunked body under the limit is served
    small = BODIES["completions"]
    r = httpx.post(f"{small_body_server.url}/v1/completions", content=iter([small[:10], small[10:]]),
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 200, r.text


def test_a_long_prompt_is_tokenized_off_the_event_loop(small_body_server):
    """Under the body limit but far over the context: /health keeps answering while the prompt is tokenized,
    then the prompt is refused with a 400."""
    prompt = "def add(a, b):\n    return a + b\n" * (LIMIT // 40)
    with HealthProbe(small_body_server.url) as probe:
        start = time.monotonic()
        r = httpx.post(f"{small_body_server.url}/v1/completions", json={"prompt": prompt, "max_tokens": 2},
                       timeout=120)
        took = time.monotonic() - start
    assert_openai_error(r, 400)
    assert set(probe.answers) == {200} and len(probe.answers) >= 2
    assert probe.slowest < max(0.5, took / 3), (probe.slowest, took)


def test_the_body_limit_flag_defaults_to_32_mib_and_refuses_nonsense(capsys):
    from kestrel.cli import build_parser, main

    parser, _ = build_parser()
    assert parser.parse_args(["serve", "m"]).max_request_body_bytes == 32 * 1024 * 1024 \
        == ServerConfig().max_request_body_bytes
    assert parser.parse_args(["serve", "m", "--max-request-body-bytes", "4096"]).max_request_body_bytes == 4096
    assert main(["serve", "m", "--max-request-body-bytes", "0"]) == 2   # before anything loads or listens
    assert "--max-request-body-bytes 0 is invalid" in capsys.readouterr().err


# ---- the key first, and no internal paths (401 before anything else) --------------------------------------------

KEY = "sesame"


@pytest.fixture(scope="module")
def keyed_server(checkpoint):
    with LiveServer(EngineConfig(model=str(checkpoint), device="cpu"),
                    ServerConfig(api_key=KEY, max_request_body_bytes=LIMIT)) as s:
        yield s


def assert_no_internal_path(message: str) -> None:
    assert "/" not in message and "\\" not in message and ".py" not in message and "line " not in message, message


@pytest.mark.parametrize("path", ["/v1/loads?dp_rank=AAA", "/v1/loads?dp_rank=0", "/get_load", "/server_info",
                                  "/get_server_info", "/model_info", "/get_model_info", "/v1/models"])
def test_without_the_key_every_keyed_route_is_a_401_whatever_else_is_wrong(keyed_server, path):
    r = httpx.get(keyed_server.url + path, timeout=30)
    assert_openai_error(r, 401, "invalid_api_key")
    r = httpx.get(keyed_server.url + path, headers={"Authorization": "Bearer wrong"}, timeout=30)
    assert_openai_error(r, 401, "invalid_api_key")


@pytest.mark.parametrize("endpoint", sorted(BODIES))
def test_without_the_key_a_post_is_a_401_before_its_type_or_size_is_looked_at(keyed_server, endpoint):
    url = f"{keyed_server.url}/v1/{endpoint}"
    assert_openai_error(httpx.post(url, content=BODIES[endpoint], headers={"content-type": "text/plain"}),
                        401, "invalid_api_key")
    assert_openai_error(httpx.post(url, content=oversized_completion(), headers={"content-type": "application/json"}),
                        401, "invalid_api_key")
    keyed = {"Authorization": f"Bearer {KEY}"}
    assert_openai_error(httpx.post(url, content=BODIES[endpoint], headers={**keyed, "content-type": "text/plain"}),
                        415, "unsupported_media_type")
    r = httpx.post(url, content=BODIES[endpoint], headers={**keyed, "content-type": "application/json"}, timeout=60)
    assert r.status_code == 200, r.text


def test_a_bad_query_parameter_is_a_400_naming_it_without_the_servers_paths(keyed_server):
    r = httpx.get(f"{keyed_server.url}/v1/loads?dp_rank=AAA", headers={"Authorization": f"Bearer {KEY}"})
    error = assert_openai_error(r, 400)
    assert error["param"] == "dp_rank" and "dp_rank" in error["message"] and "'AAA'" in error["message"]
    assert_no_internal_path(error["message"])


def test_an_unexpected_exception_is_answered_without_file_paths():
    from kestrel.server.serving import api_error_from

    exc = FileNotFoundError(2, "No such file or directory", "/work/secret/models/x/tokenizer.json")
    err = api_error_from(exc)
    assert err.status == 500 and "FileNotFoundError" in err.message and "<path>" in err.message
    assert "/work" not in err.message and "secret" not in err.message


# ---- OpenAI's defaults --------------------------------------------------------------------------------------------

def test_max_tokens_null_on_completions_is_openais_default_16(server):
    for body in ({"prompt": "def main(", "max_tokens": None, "ignore_eos": True},
                 {"prompt": "def main(", "ignore_eos": True}):
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 16 and r.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("stop", ["", [""], ["", ""], None])
def test_an_empty_stop_string_means_no_stop_string_in_a_string_or_a_list(server, stop):
    body = {"prompt": "def main(", "max_tokens": 4, "ignore_eos": True, "temperature": 0, "stop": stop}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4
    unstopped = httpx.post(f"{server.url}/v1/completions", json=dict(body, stop=None), timeout=60).json()
    assert r.json()["choices"][0]["text"] == unstopped["choices"][0]["text"]


@pytest.mark.parametrize("endpoint,body,param", [
    ("completions", {"prompt": "x", "n": 1025}, "n"),
    ("completions", {"prompt": ["x"] * 33, "n": 32}, "prompt"),
    ("completions", {"prompt": [[1, 2]] * 1025}, "prompt"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 1025}, "n"),
])
def test_a_request_may_create_at_most_1024_sequences(server, endpoint, body, param):
    r = httpx.post(f"{server.url}/v1/{endpoint}", json=dict(body, max_tokens=1), timeout=60)
    error = assert_openai_error(r, 400)
    assert error["param"] == param and "1024" in error["message"]
    assert server.engine.num_in_flight() == 0


def test_prompts_times_n_up_to_the_bound_are_served(server):
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": ["x"] * 4, "n": 2, "max_tokens": 1}, timeout=60)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 8
