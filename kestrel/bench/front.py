"""A byte-level relay in front of the router that gives a request without `model` the served model's name.

`kestrel serve` (like vLLM) answers a request that names no model with the model it serves; smg 1.13.0 refuses it
(400 "missing field `model`": its request types require the field), so the same request that works against one
replica fails through the router. This relay listens on the launch's --port and forwards every connection to the
router as it is, except that the body of a generation request (POST /v1/completions, /v1/chat/completions, ...)
that is a JSON object without `model` (or with null) gets `"model": <served name>` first.

    client ──► relay :PORT ── requests parsed (head + body), rewritten when model is missing ──► smg :internal
           ◄────────────────── responses copied byte for byte, as they arrive (SSE unbuffered) ◄──

Only the request side is parsed (HTTP/1.1: Content-Length or chunked bodies, Expect: 100-continue); responses go
back as raw bytes, in order, since each client connection has its own connection to the router. An Upgrade
request switches the connection to a raw two-way pipe.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import threading

FILL_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings",
                        "/v1/messages"})
MAX_FILL_BODY = 64 * 2**20    # larger bodies pass through as they are (the server's own limit answers them)
COPY_SIZE = 64 * 2**10


class _BadRequest(Exception):
    def __init__(self, status: str, message: str) -> None:
        super().__init__(message)
        self.status = status


def fill_model(body: bytes, model: str) -> bytes | None:
    """The body with `"model": model` when it is a JSON object without one; None: leave it as it is."""
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(obj, dict) or obj.get("model") is not None:
        return None
    obj["model"] = model
    return json.dumps(obj, ensure_ascii=False).encode()


def _parse_head(head: bytes) -> tuple[str, str, list[tuple[str, str]]]:
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3:
        raise _BadRequest("400 Bad Request", "malformed request line")
    headers = []
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep:
            raise _BadRequest("400 Bad Request", "malformed header line")
        headers.append((name.strip(), value.strip()))
    return parts[0], parts[1], headers


def _header(headers: list[tuple[str, str]], name: str) -> str | None:
    for key, value in headers:
        if key.lower() == name:
            return value
    return None


def _build_head(method: str, target: str, headers: list[tuple[str, str]], length: int) -> bytes:
    drop = {"content-length", "transfer-encoding", "expect"}
    lines = [f"{method} {target} HTTP/1.1"] + [f"{k}: {v}" for k, v in headers if k.lower() not in drop]
    lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


async def _read_chunked(reader: asyncio.StreamReader, limit: int) -> bytes:
    body = bytearray()
    while True:
        size_line = await reader.readuntil(b"\r\n")
        try:
            size = int(size_line.split(b";")[0].strip(), 16)
        except ValueError:
            raise _BadRequest("400 Bad Request", "malformed chunk size") from None
        if size == 0:
            while await reader.readuntil(b"\r\n") != b"\r\n":   # trailers, then the blank line
                pass
            return bytes(body)
        if len(body) + size > limit:
            raise _BadRequest("413 Content Too Large", "request body too large")
        body += await reader.readexactly(size)
        await reader.readexactly(2)


async def _copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int | None = None) -> None:
    """n bytes (None: until EOF) from reader to writer."""
    while n is None or n > 0:
        data = await reader.read(COPY_SIZE if n is None else min(COPY_SIZE, n))
        if not data:
            return
        writer.write(data)
        await writer.drain()
        if n is not None:
            n -= len(data)


class ModelFillingRelay:
    """Run with start() (a thread of its own with an event loop), end with stop()."""

    def __init__(self, host: str, port: int, upstream_host: str, upstream_port: int, model: str) -> None:
        self.host, self.port = host, port
        self.upstream = (upstream_host, upstream_port)
        self.model = model
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="model-filling-relay")
        self._server: asyncio.base_events.Server | None = None
        self._connections: set[asyncio.Task] = set()

    def start(self) -> None:
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, self.host, self.port), self._loop)
        self._server = future.result(timeout=10)   # OSError (port taken) reaches the caller

    def stop(self) -> None:
        async def shutdown() -> None:
            if self._server is not None:
                self._server.close()
            for task in list(self._connections):
                task.cancel()
            await asyncio.gather(*self._connections, return_exceptions=True)

        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._connections.add(task)
        try:
            await self._relay(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError):
            pass
        finally:
            self._connections.discard(task)
            writer.close()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            _answer(writer, "502 Bad Gateway", "the router is not answering", "server_error")
            return
        responses = asyncio.create_task(_copy(up_reader, writer))
        responses.add_done_callback(_settled)
        read: asyncio.Future | None = None
        try:
            while True:
                # the next request, unless the router closes the connection first (an idle keep-alive timeout):
                # then this one closes too, so that the client reconnects instead of writing into the void
                read = asyncio.ensure_future(reader.readuntil(b"\r\n\r\n"))
                read.add_done_callback(_settled)
                await asyncio.wait({read, responses}, return_when=asyncio.FIRST_COMPLETED)
                if not read.done():
                    read.cancel()
                    return
                try:
                    head = read.result()
                except asyncio.IncompleteReadError:
                    return   # the client closed the connection between requests
                except asyncio.LimitOverrunError:
                    _answer(writer, "431 Request Header Fields Too Large", "request headers too large")
                    return
                try:
                    if not await self._forward(head, reader, writer, up_writer):
                        await _copy(reader, up_writer)   # upgraded: a raw pipe from here on
                        return
                except _BadRequest as exc:
                    _answer(writer, exc.status, str(exc))
                    return
        finally:
            if read is not None and not read.done():
                read.cancel()
            up_writer.close()
            with contextlib.suppress(asyncio.CancelledError, ConnectionError, OSError, asyncio.TimeoutError):
                await asyncio.wait_for(responses, timeout=600)   # the last response, to its end

    async def _forward(self, head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                       up_writer: asyncio.StreamWriter) -> bool:
        """Forward one request; False when it upgraded the connection (no more HTTP requests on it)."""
        method, target, headers = _parse_head(head)
        if (_header(headers, "expect") or "").lower() == "100-continue":
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")   # the router sees no Expect: the body comes at once
        chunked = "chunked" in (_header(headers, "transfer-encoding") or "").lower()
        length = int(_header(headers, "content-length") or 0) if not chunked else None
        fills = method == "POST" and target.split("?", 1)[0] in FILL_PATHS
        if chunked:
            body = await _read_chunked(reader, MAX_FILL_BODY)
        elif fills and length <= MAX_FILL_BODY:
            body = await reader.readexactly(length)
        else:   # not ours to look at: straight through
            up_writer.write(_build_head(method, target, headers, length) if _header(headers, "expect") else head)
            await _copy(reader, up_writer, length)
            return _header(headers, "upgrade") is None
        if fills and (filled := fill_model(body, self.model)) is not None:
            body = filled
        up_writer.write(_build_head(method, target, headers, len(body)) + body)
        await up_writer.drain()
        return True


def _settled(task: asyncio.Future) -> None:
    """Mark a finished task's exception as seen: a connection that ends mid-read is not an error to log (at
    garbage collection, as "Task exception was never retrieved")."""
    if not task.cancelled():
        task.exception()


def _answer(writer: asyncio.StreamWriter, status: str, message: str,
            kind: str = "invalid_request_error") -> None:
    body = json.dumps({"error": {"message": message, "type": kind, "code": None,
                                 "param": None}}).encode()
    writer.write(f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                 f"Connection: close\r\n\r\n".encode() + body)
