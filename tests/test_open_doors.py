"""No open doors (issue 53): what a web page, an oversized body or a caller without the key can do to a server.
A real uvicorn on loopback (tests/test_server.py's LiveServer), raw HTTP through httpx."""
from __future__ import annotations

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
