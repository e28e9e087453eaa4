"""Streaming under load: many concurrent streams each carry every token in order and the non-streamed text, and a
stream whose reader fell behind catches up in chunks of several tokens whose running usage stays exact. A real
server on loopback; chunks are checked against the official client's types."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletionChunk

from kestrel.config import EngineConfig
from tests.test_server import LiveServer

pytestmark = pytest.mark.slow   # 48 concurrent streams against a live server

CONCURRENCY = 48
MAX_TOKENS = 24
STALL_S = 1.0   # the flood test's hold-up: long enough for 32 streams' events to fill the engine's pipe


def hold_until_the_engine_rests(cap_s: float = 60.0) -> None:
    """Block the calling thread (the server's event loop) until the engine process, a child of this one, stops
    using CPU: it has made every token it can meanwhile. Waiting on the work rather than a fixed time keeps the
    test independent of the machine's speed; the cap only bounds a hang."""
    from kestrel.progress import descendant_cpu_seconds

    start, last, still_since = time.monotonic(), descendant_cpu_seconds(), time.monotonic()
    while time.monotonic() - start < cap_s:
        time.sleep(0.1)
        now = descendant_cpu_seconds()
        if now > last + 0.02:
            last, still_since = now, time.monotonic()
        elif time.monotonic() - still_since >= 0.5:
            return


@pytest.fixture(scope="module")
def server(checkpoint_factory):
    with LiveServer(EngineConfig(model=str(checkpoint_factory("llama")), device="cpu")) as s:
        yield s


def body(i: int, stream: bool, max_tokens: int = MAX_TOKENS) -> dict:
    return {"prompt": f"item {i}: def f{i}(", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream, "stream_options": {"include_usage": True, "continuous_usage_stats": True} if stream
            else None}


async def read_stream(client: httpx.AsyncClient, url: str, payload: dict, on_first=None) -> list[dict]:
    """Every chunk of one SSE response, parsed; checks the framing ends with [DONE]."""
    chunks: list[dict] = []
    async with client.stream("POST", url, json=payload) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                return chunks
            chunks.append(json.loads(data))
            if on_first is not None and len(chunks) == 1:
                on_first()
    raise AssertionError("the stream ended without data: [DONE]")


def check_completion_chunk(chunk: dict) -> None:
    """A streamed text_completion chunk as the official client reads it (its Completion type demands a
    finish_reason, which a stream's chunks carry only at the end, so the fields are checked here)."""
    assert chunk["object"] == "text_completion" and chunk["id"].startswith("cmpl-")
    assert isinstance(chunk["created"], int) and isinstance(chunk["model"], str)
    for choice in chunk["choices"]:
        assert isinstance(choice["index"], int) and isinstance(choice["text"], str)
        assert choice["finish_reason"] in (None, "stop", "length")
    if chunk["choices"] and chunk["choices"][0]["finish_reason"] is not None:   # the last one is a full Completion
        Completion.model_validate(chunk)


def check_running_usage(chunks: list[dict], expected_tokens: int) -> list[int]:
    """Tokens each content chunk carried, from the running usage; the final usage chunk has the total."""
    *content, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == expected_tokens
    running = [c["usage"]["completion_tokens"] for c in content]
    per_chunk = [b - a for a, b in zip([0] + running, running)]
    assert all(n >= 0 for n in per_chunk) and sum(per_chunk) == expected_tokens
    assert all(c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + c["usage"]["completion_tokens"]
               for c in chunks)
    return per_chunk


def test_concurrent_streams_carry_every_token_and_the_non_streamed_text(server):
    url = f"{server.url}/v1/completions"

    async def go():
        limits = httpx.Limits(max_connections=2 * CONCURRENCY + 8)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            streams = [read_stream(client, url, body(i, True)) for i in range(CONCURRENCY)]
            whole = [client.post(url, json=body(i, False)) for i in range(CONCURRENCY)]
            return await asyncio.gather(*streams), await asyncio.gather(*whole)

    streamed, whole = asyncio.run(go())
    for chunks, response in zip(streamed, whole):
        expected = Completion.model_validate(response.json())
        for c in chunks:
            check_completion_chunk(c)
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == expected.choices[0].text
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
        check_running_usage(chunks, expected.usage.completion_tokens)
        assert expected.usage.completion_tokens == MAX_TOKENS


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_a_reader_that_fell_behind_gets_several_tokens_per_chunk_with_exact_usage(server, endpoint):
    """The server's event loop is held up after the first chunk (as a loaded server's is) while the engine, in its
    own process, keeps stepping: the steps queued meanwhile leave in a few chunks, not one chunk per step."""
    url = f"{server.url}/v1/{endpoint}"
    payload = body(0, True, max_tokens=64)
    if endpoint == "chat/completions":
        payload["messages"] = [{"role": "user", "content": payload.pop("prompt")}]

    def stall_the_server() -> None:
        server.server._loop.call_soon_threadsafe(hold_until_the_engine_rests)

    async def go():
        async with httpx.AsyncClient(timeout=120) as client:
            chunks = await read_stream(client, url, payload, on_first=stall_the_server)
            whole = (await client.post(url, json=dict(payload, stream=False, stream_options=None))).json()
            return chunks, whole

    chunks, whole = asyncio.run(go())
    if endpoint == "completions":
        for c in chunks:
            check_completion_chunk(c)
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        expected = whole["choices"][0]["text"]
    else:
        for c in chunks:
            ChatCompletionChunk.model_validate(c)
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        expected = whole["choices"][0]["message"]["content"]
    assert text == expected
    per_chunk = check_running_usage(chunks, whole["usage"]["completion_tokens"])
    assert whole["usage"]["completion_tokens"] == 64
    # One chunk per step would be 64 (fewer only where text is held back at a partial UTF-8 character).
    assert max(per_chunk) > 1 and len(per_chunk) <= 32



def test_a_flood_of_commands_while_the_engine_waits_to_send_events_does_not_deadlock(server):
    """The event loop is held up while 32 streams run, so the engine's events fill their pipe and the engine waits
    to write; then the loop sends far more commands than a pipe holds (aborts of unknown ids: no-ops for the
    engine). Were the engine not reading commands while it waits (engine_process.py's _PipeCommands), each
    process would wait on the other's pipe forever."""
    url = f"{server.url}/v1/completions"

    def jam() -> None:
        time.sleep(STALL_S)
        for i in range(3000):   # ~400 KB of commands against a 64 KiB pipe
            server.engine.abort(f"no-such-request-{i:0100d}")

    async def go():
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(timeout=30, limits=limits) as client:
            streams = [read_stream(client, url, body(i, True, max_tokens=128),
                                   on_first=(lambda: server.server._loop.call_soon_threadsafe(jam)) if i == 0
                                   else None)
                       for i in range(32)]
            return await asyncio.gather(*streams)

    for chunks in asyncio.run(go()):
        assert chunks[-1]["usage"]["completion_tokens"] == 128
