"""The relay `kestrel launch --replicas` puts in front of the router (kestrel/bench/front.py): a generation request
without `model` gets the served name, everything else passes byte for byte, responses stream as they come.

Here the upstream is a small real HTTP server that echoes what it received (the relay in front of the real smg and
real replicas: tests/test_launch_restart.py)."""
from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from kestrel.bench.front import ModelFillingRelay, fill_model
from kestrel.bench.replicas import free_port


class Echo(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"   # keep-alive, as smg speaks it

    def log_message(self, *args) -> None:
        pass

    def _reply(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/stream":   # three SSE events 0.5 s apart, chunked
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i in range(3):
                event = f"data: {i}\n\n".encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                self.wfile.flush()
                time.sleep(0.5)
            self.wfile.write(b"0\r\n\r\n")
            return
        if self.path == "/then-close":   # as a router closing an idle keep-alive connection, without notice
            self.close_connection = True
        self._reply(json.dumps({"path": self.path}).encode())

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self._reply(json.dumps({"path": self.path, "body": body.decode(), "expect": self.headers.get("Expect"),
                                "connection": id(self.connection)}).encode())


@pytest.fixture(scope="module")
def relay():
    upstream = ThreadingHTTPServer(("127.0.0.1", 0), Echo)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    port = free_port()
    front = ModelFillingRelay("127.0.0.1", port, "127.0.0.1", upstream.server_address[1], "kestrel-tiny")
    front.start()
    yield f"http://127.0.0.1:{port}"
    front.stop()
    upstream.shutdown()


def test_a_request_without_model_gets_the_served_model(relay):
    with httpx.Client(base_url=relay, timeout=10) as client:
        for path in ("/v1/completions", "/v1/chat/completions"):
            got = client.post(path, json={"prompt": "hi", "max_tokens": 2}).json()
            assert got["path"] == path and json.loads(got["body"]) == {"prompt": "hi", "max_tokens": 2,
                                                                         "model": "kestrel-tiny"}
        got = client.post("/v1/completions", json={"model": None, "prompt": "x"}).json()
        assert json.loads(got["body"])["model"] == "kestrel-tiny"
        raw = b'{"model": "other",  "prompt": "x"}'   # named: passed as it is, byte for byte
        assert client.post("/v1/completions", content=raw).json()["body"] == raw.decode()
        assert client.post("/v1/completions", content=b"not json").json()["body"] == "not json"
        assert client.post("/workers", json={"url": "u"}).json()["body"] == '{"url":"u"}'   # not a generation route
        assert client.get("/v1/models?x=1").json() == {"path": "/v1/models?x=1"}


def test_keep_alive_chunked_and_expect_100_continue(relay):
    with httpx.Client(base_url=relay, timeout=10) as client:
        connections = {client.post("/v1/completions", json={"prompt": str(i)}).json()["connection"]
                       for i in range(5)}
        assert len(connections) == 1   # five requests, one connection to the upstream: keep-alive carried through
        chunks = iter([b'{"prompt": ', b'"chunked"}'])
        got = client.post("/v1/completions", content=chunks).json()   # an iterator: Transfer-Encoding: chunked
        assert json.loads(got["body"]) == {"prompt": "chunked", "model": "kestrel-tiny"}
    port = int(relay.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:   # as curl sends a large body
        body = b'{"prompt": "expect"}'
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(body))
        assert sock.recv(100).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        sock.sendall(body)
        answer = b""
        while not answer.endswith(b"}"):   # the echo's JSON body ends the response
            answer += sock.recv(4096)
    echoed = json.loads(answer.split(b"\r\n\r\n", 1)[1])
    assert json.loads(echoed["body"])["model"] == "kestrel-tiny" and echoed["expect"] is None


def test_a_connection_the_router_closes_is_closed_to_the_client_too(relay):
    with httpx.Client(base_url=relay, timeout=10) as client:
        assert client.get("/then-close").status_code == 200
        time.sleep(0.5)   # the relay noticed, and closed its side: the client's next request takes a new connection
        assert json.loads(client.post("/v1/completions", json={"prompt": "again"}).json()["body"])["model"]


def test_no_router_behind_is_a_502_in_the_openai_error_format():
    port = free_port()
    front = ModelFillingRelay("127.0.0.1", port, "127.0.0.1", free_port(), "m")
    front.start()
    try:
        resp = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "x"}, timeout=10)
    finally:
        front.stop()
    assert resp.status_code == 502 and resp.json()["error"]["type"] == "server_error"


def test_a_streamed_response_arrives_as_it_is_sent(relay):
    arrivals = []
    start = time.monotonic()
    with httpx.stream("GET", relay + "/stream", timeout=10) as resp:
        for line in resp.iter_lines():
            if line:
                arrivals.append((line, time.monotonic() - start))
    assert [line for line, _ in arrivals] == ["data: 0", "data: 1", "data: 2"]
    assert arrivals[0][1] < 0.4 < arrivals[-1][1]   # the first event long before the last: not buffered


def test_fill_model_leaves_what_is_not_a_model_less_object():
    assert fill_model(b'{"prompt": "a"}', "m") == b'{"prompt": "a", "model": "m"}'
    assert fill_model(b'[1, 2]', "m") is None and fill_model(b'{"model": "x"}', "m") is None
    assert fill_model(b'\xff', "m") is None
