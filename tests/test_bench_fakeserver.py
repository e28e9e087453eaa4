"""A real OpenAI-compatible HTTP server with a known timing, for the bench tests (and its own contract).

Each completion streams its first token `ttft_s` after the request arrives, then one chunk every `gap_s`;
chunk i (after the first) carries `pattern[i % len(pattern)]` tokens, until max_tokens tokens were sent.
Chunks are scheduled against absolute deadlines, so the arrival times are known up to scheduler jitter.
"""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass, field

import httpx
from aiohttp import web


def chunk_plan(max_tokens: int, ttft_s: float, gap_s: float, pattern: tuple[int, ...]) -> list[tuple[float, int]]:
    """[(send time after the request, tokens in the chunk)]"""
    plan, sent, i = [(ttft_s, 1)], 1, 0
    while sent < max_tokens:
        k = min(pattern[i % len(pattern)], max_tokens - sent)
        plan.append((ttft_s + gap_s * (i + 1), k))
        sent, i = sent + k, i + 1
    return plan


@dataclass
class FakeOpenAIServer:
    ttft_s: float = 0.2
    gap_s: float = 0.05
    pattern: tuple[int, ...] = (1, 3)
    reject_extra_params: bool = False      # answer 400 to ignore_eos/min_tokens/continuous usage, like OpenAI
    usage: bool = True                     # report usage (final and, when asked, on every chunk)
    fail_every: int = 0                    # every Nth request answers 500
    model: str = "fake-model"
    requests_seen: list[dict] = field(default_factory=list)
    accepted_tokens: int = 0               # kestrel:spec_decode_* counters grow with each request

    def __enter__(self) -> "FakeOpenAIServer":
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        sock.close()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        started = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(started,), daemon=True)
        self._thread.start()
        assert started.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _serve(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/v1/chat/completions", self._complete)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/version", self._version)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port).start())
        started.set()
        self._loop.run_forever()

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    async def _version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": "fake-1.0"})

    async def _metrics(self, request: web.Request) -> web.Response:
        n = len(self.requests_seen)
        text = ("# TYPE kestrel:spec_decode_num_drafts_total counter\n"
                f'kestrel:spec_decode_num_drafts_total{{model_name="{self.model}"}} {10 * n}\n'
                f"kestrel:spec_decode_num_draft_tokens_total {30 * n}\n"
                f"kestrel:spec_decode_num_accepted_tokens_total {15 * n}\n"
                "# TYPE kestrel:spec_decode_num_accepted_tokens_per_pos_total counter\n"
                f'kestrel:spec_decode_num_accepted_tokens_per_pos_total{{model_name="{self.model}",position="0"}} '
                f"{8 * n}\n"
                f'kestrel:spec_decode_num_accepted_tokens_per_pos_total{{model_name="{self.model}",position="1"}} '
                f"{5 * n}\n"
                f'kestrel:spec_decode_num_accepted_tokens_per_pos_total{{model_name="{self.model}",position="2"}} '
                f"{2 * n}\n")
        return web.Response(text=text)

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        start = asyncio.get_running_loop().time()
        body = await request.json()
        self.requests_seen.append(body)
        chat = request.path.endswith("chat/completions")
        options = body.get("stream_options") or {}
        if self.reject_extra_params and ("ignore_eos" in body or "min_tokens" in body
                                         or "continuous_usage_stats" in options):
            return web.json_response({"error": {"message": "unknown parameter"}}, status=400)
        if self.fail_every and len(self.requests_seen) % self.fail_every == 0:
            return web.json_response({"error": {"message": "boom"}}, status=500)
        plan = chunk_plan(int(body["max_tokens"]), self.ttft_s, self.gap_s, self.pattern)
        total = sum(k for _, k in plan)
        usage = {"prompt_tokens": 7, "completion_tokens": total, "total_tokens": 7 + total}
        if not body.get("stream"):
            await asyncio.sleep(max(0.0, start + plan[-1][0] - asyncio.get_running_loop().time()))
            text = "tok " * total
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
                      if chat else {"index": 0, "text": text, "finish_reason": "length"})
            return web.json_response({"id": "x", "choices": [choice], "usage": usage if self.usage else None})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        sent = 0
        for i, (at, k) in enumerate(plan):
            await asyncio.sleep(max(0.0, start + at - asyncio.get_running_loop().time()))
            sent += k
            text = "tok " * k
            last = i == len(plan) - 1
            choice = ({"index": 0, "delta": {"content": text}, "finish_reason": "length" if last else None}
                      if chat else {"index": 0, "text": text, "finish_reason": "length" if last else None})
            chunk = {"id": "x", "choices": [choice]}
            if self.usage and options.get("continuous_usage_stats"):
                chunk["usage"] = {"prompt_tokens": 7, "completion_tokens": sent, "total_tokens": 7 + sent}
            # two events in one write: clients must split on lines, not on TCP reads
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode() + (b": keep-alive\n\n" if i % 2 else b""))
        if self.usage and options.get("include_usage"):
            await resp.write(f"data: {json.dumps({'id': 'x', 'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp


def test_fake_server_streams_its_plan_with_multi_token_chunks():
    plan = chunk_plan(6, 0.2, 0.05, (1, 3))
    assert [k for _, k in plan] == [1, 1, 3, 1]
    assert [round(t, 6) for t, _ in plan] == [0.2, 0.25, 0.3, 0.35]
    with FakeOpenAIServer(ttft_s=0.05, gap_s=0.01) as server:
        start = time.perf_counter()
        with httpx.stream("POST", server.base_url + "/v1/completions",
                          json={"model": "m", "prompt": "hi", "max_tokens": 5, "stream": True,
                                "stream_options": {"include_usage": True}}) as resp:
            lines = [line for line in resp.iter_lines() if line.startswith("data:")]
        assert time.perf_counter() - start >= 0.07
    chunks = [json.loads(line[5:]) for line in lines[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == "tok " * 5
    assert chunks[-1]["usage"]["completion_tokens"] == 5
    assert lines[-1] == "data: [DONE]"
