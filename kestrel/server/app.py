"""The FastAPI app: OpenAI-compatible endpoints in front of one AsyncEngine.

    GET  /health                 {"phase", "progress", "elapsed_s"}: 503 while starting (or stalled/failed), 200 ready
    GET  /metrics                Prometheus text, `kestrel:` namespace
    GET  /version                {"version"}
    GET  /v1/models              the served model
    GET  /v1/loads               the load a router reads (running, waiting, KV tokens), SGLang's schema; /get_load:
                                 the older routers' form
    GET  /server_info, /model_info (and /get_server_info, /get_model_info): what a router reads at registration
                                 (server/router_info.py)
    POST /v1/completions         text completions, streamed or not
    POST /v1/chat/completions    chat completions, streamed or not

Every error is answered in OpenAI's format {"error": {"message", "type", "param", "code"}}: 4xx for what the
client got wrong, 503 while starting or when the queue is full, 500 only when the engine itself failed.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import request_response

import kestrel
from kestrel.config import EngineConfig
from kestrel.errors import KestrelError
from kestrel.frontend.async_engine import AsyncEngine
from kestrel.server import chat, completions, tools
from kestrel.server.log_lines import StatsLogger
from kestrel.frontend.first_token import FirstTokenTrace
from kestrel.server import router_info
from kestrel.server.metrics import CONTENT_TYPE, RECEIVED, ServerMetrics, StampReceived
from kestrel.server.openapi import ERROR_RESPONSES, install_openapi, request_body
from kestrel.server.protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                                     CompletionResponse, error_body)
from kestrel.server.serving import APIError, Generation, TokenText, api_error_from, check_model, \
    check_sequences, run_to_completion, sampling_params
from kestrel.server.startup import StartupProgress
from kestrel.server.structured import structured_output

logger = logging.getLogger("kestrel.server")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    api_key: str | None = None            # Bearer token required on /v1/*; None: open
    max_queue: int | None = None          # requests waiting for their first token beyond which new ones get 503
    stall_timeout_s: float | None = 300.0  # startup phase without progress this long -> "stalled" + stack dump
    shutdown_timeout_s: float = 5.0       # how long to wait for the engine to stop before terminating it
    engine_in_thread: bool = False        # run the engine on a thread of the server (one GIL) instead of a process
    log_requests: bool = True             # a log line per finished request
    log_stats_interval_s: float | None = 5.0  # seconds between throughput lines (only when busy); None: off
    max_request_body_bytes: int = 32 * 1024 * 1024   # a larger POST body is a 413, refused before it is read
    tool_call_parser: str | None = None   # the family parser of tool_choice "auto" (server/tool_parsers); None: off


class ServerState:
    """What the handlers share; one per app."""

    def __init__(self, engine_config: EngineConfig, config: ServerConfig) -> None:
        self.config = config
        self.model_name = engine_config.model_name
        self.model_root = model_root(engine_config)
        self.progress = StartupProgress(stall_timeout_s=config.stall_timeout_s)
        self.engine = AsyncEngine(engine_config, self.progress, max_queue=config.max_queue,
                                  in_thread=config.engine_in_thread)
        self.metrics = ServerMetrics(self.engine.stats, self.model_name)
        self.identity = router_info.WorkerIdentity(
            model_name=self.model_name, model_path=self.model_root,
            tokenizer_path=_tokenizer_root(engine_config, self.model_root), block_size=engine_config.block_size,
            max_num_seqs=engine_config.max_num_seqs, tensor_parallel_size=engine_config.tensor_parallel_size)
        self.throughput = router_info.ThroughputMeter()
        self._token_text: TokenText | None = None

    def token_text(self) -> TokenText:
        if self._token_text is None:
            self._token_text = TokenText(self.engine.tokenizer)
        return self._token_text


def model_root(engine_config: EngineConfig) -> str:
    """/v1/models' `root`: the absolute path of the checkpoint being served (directory or .gguf file), as vLLM
    reports the path it loaded; `kestrel bench serve` reads the tokenizer from there. The served name when the
    path cannot be resolved (the engine then fails to start and says why)."""
    try:
        return str(engine_config.model_path.expanduser().resolve())
    except (KestrelError, OSError):
        return engine_config.model_name


def _tokenizer_root(engine_config: EngineConfig, model_root: str) -> str:
    """/model_info's tokenizer_path: --tokenizer's directory (a Hub id's snapshot), else the model's root."""
    if engine_config.tokenizer is None:
        return model_root
    try:
        return str(engine_config.tokenizer_path.expanduser().resolve())
    except (KestrelError, OSError):
        return engine_config.tokenizer


def build_app(engine_config: EngineConfig, config: ServerConfig | None = None) -> FastAPI:
    config = config or ServerConfig()
    state = ServerState(engine_config, config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.progress.start_watchdog(engine_stacks=state.engine.engine_stacks)
        state.engine.start()   # spawns the engine process, which builds the Engine; the port is open meanwhile
        stats_task = None
        if config.log_stats_interval_s:
            stats_task = asyncio.create_task(StatsLogger(state.engine.stats, config.log_stats_interval_s).run())
        try:
            yield
        finally:
            if stats_task is not None:
                stats_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await stats_task
            await state.engine.shutdown(config.shutdown_timeout_s)
            state.progress.stop_watchdog()

    # /openapi.json and /docs are open even with --api-key (server/openapi.py says why)
    app = FastAPI(title="Kestrel", version=kestrel.__version__, lifespan=lifespan, docs_url="/docs", redoc_url=None,
                  description="OpenAI-compatible LLM inference server")
    app.state.kestrel = state
    app.add_middleware(StampReceived)
    _add_error_handlers(app)
    install_openapi(app, [CompletionRequest, ChatCompletionRequest])

    async def require_key(request: Request) -> None:
        _check_auth(request, config.api_key)

    # The key is checked before anything of the request is: route dependencies run before FastAPI validates the
    # query parameters, so a caller without the key learns nothing from a 400 (GET /v1/loads?dp_rank=AAA).
    # The POST routes check it themselves, first (they are served plain, see _serve_plain).
    keyed = [Depends(require_key)]

    @app.get("/health")
    async def health() -> JSONResponse:
        status = state.progress.status()
        return JSONResponse(status, status_code=200 if state.engine.ready else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/version")
    async def version() -> dict:
        return {"version": kestrel.__version__}

    @app.get("/v1/models", dependencies=keyed)
    async def models(request: Request) -> dict:
        card = {"id": state.model_name, "object": "model", "created": 0, "owned_by": "kestrel",
                "root": state.model_root, "parent": None}
        if state.engine.ready:
            card["max_model_len"] = state.engine.max_model_len
        return {"object": "list", "data": [card]}

    @app.get("/v1/loads", dependencies=keyed)
    async def loads(request: Request, dp_rank: int | None = None) -> JSONResponse:
        _check_ready(state)
        stats = state.engine.stats()
        rate = state.throughput.update(stats.generation_tokens_total if stats else 0)
        return JSONResponse(router_info.loads_body(state.identity, state.engine.limits, stats, rate,
                                                       state.engine.num_in_flight(), dp_rank))

    @app.get("/get_load", dependencies=keyed)
    async def legacy_load(request: Request) -> JSONResponse:
        _check_ready(state)
        return JSONResponse(router_info.legacy_load_body(state.identity, state.engine.limits, state.engine.stats(),
                                                         state.engine.num_in_flight()))

    @app.get("/server_info", dependencies=keyed)
    @app.get("/get_server_info", dependencies=keyed)
    async def server_info(request: Request) -> dict:
        return router_info.server_info_body(state.identity, state.engine.limits if state.engine.ready else None)

    @app.get("/model_info", dependencies=keyed)
    @app.get("/get_model_info", dependencies=keyed)
    async def model_info(request: Request) -> dict:
        return router_info.model_info_body(state.identity)

    @app.post("/v1/completions", openapi_extra=request_body(CompletionRequest),
              responses={200: {"model": CompletionResponse, "description": "the completion; with `stream`, "
                               "server-sent events of chunks, then `data: [DONE]`"}, **ERROR_RESPONSES})
    async def create_completion(request: Request) -> Response:
        trace = _trace(request)
        _check_auth(request, config.api_key)
        req = await _parse_body(CompletionRequest, await _json_body(request, config.max_request_body_bytes))
        check_model(req.model, state.model_name)
        completions.check_unsupported(req)
        check_sequences(completions.num_prompts(req), req.n)
        params = sampling_params(req, completions.max_tokens(req), req.logprobs)
        params.structured_output = await structured_output(req)
        trace.parsed = time.monotonic()
        try:
            prompts = await _tokenize(completions.prompt_token_ids, req, state.engine.tokenizer,
                                      completions.has_text(req))
        except Exception as exc:   # noqa: BLE001 - not ready yet, or a prompt the tokenizer refuses
            raise api_error_from(exc, param="prompt") from None
        trace.tokenized = time.monotonic()
        gen = Generation(state.engine, state.metrics, prompts, params, "cmpl", config.log_requests, trace)
        return await _respond(request, gen, req.stream, req.stream_options, completions, state,
                              want_logprobs=req.logprobs is not None, param="prompt")

    @app.post("/v1/chat/completions", openapi_extra=request_body(ChatCompletionRequest),
              responses={200: {"model": ChatCompletionResponse, "description": "the chat completion; with "
                               "`stream`, server-sent events of chunks, then `data: [DONE]`"}, **ERROR_RESPONSES})
    async def create_chat_completion(request: Request) -> Response:
        trace = _trace(request)
        _check_auth(request, config.api_key)
        req = await _parse_body(ChatCompletionRequest, await _json_body(request, config.max_request_body_bytes))
        check_model(req.model, state.model_name)
        check_sequences(1, req.n)
        tool_plan = tools.plan(req, config.tool_call_parser)
        params = sampling_params(req, chat.max_tokens(req), chat.top_logprobs(req), chat.field_names(req))
        params.structured_output = await structured_output(req)
        trace.parsed = time.monotonic()
        try:
            tokenizer = state.engine.tokenizer
            # on a worker thread: "required" / a named function check their schemas with xgrammar (cached)
            eos_texts = await asyncio.to_thread(tools.apply, tool_plan, params, tokenizer)
            prompt = await _tokenize(functools.partial(chat.prompt_token_ids, tools=tool_plan.template_tools),
                                     req, tokenizer)
        except Exception as exc:   # noqa: BLE001
            raise api_error_from(exc, param="messages") from None
        trace.tokenized = time.monotonic()
        gen = Generation(state.engine, state.metrics, [prompt], params, "chatcmpl", config.log_requests, trace)
        return await _respond(request, gen, req.stream, req.stream_options, chat.ChatFormat(tool_plan, eos_texts),
                              state, want_logprobs=req.logprobs, param="messages")

    for route in app.routes:
        if isinstance(route, APIRoute) and route.path in ("/v1/completions", "/v1/chat/completions"):
            _serve_plain(route)
    return app


def _serve_plain(route: APIRoute) -> None:
    """Run a documented route's handler through Starlette's plain request/response wrapper. The handler takes
    the Request and returns a Response itself (it parses its own body, see openapi.py), so FastAPI's per-request
    machinery (dependency solving, exit stacks) has nothing to do for it, and costs ~20 us warm and ~100 us in a
    server that sat idle, on every request's way to its first token. The route stays in the OpenAPI document and
    keeps the exception handlers (Starlette's wrapper applies them, as FastAPI's does)."""
    route.app = request_response(route.endpoint)


async def _respond(request: Request, gen: Generation, stream: bool, stream_options, fmt, state: ServerState,
                   want_logprobs: bool, param: str) -> Response:
    """Submit (refusals become 4xx/503 before any byte is sent), then stream or collect the answer."""
    try:
        await gen.start()
    except Exception as exc:   # noqa: BLE001
        raise api_error_from(exc, param=param) from None
    token_text = state.token_text()
    if stream:
        include_usage = bool(stream_options and stream_options.include_usage)
        continuous = include_usage and stream_options.continuous_usage_stats
        return StreamingResponse(fmt.stream(gen, state.model_name, token_text, want_logprobs, include_usage,
                                            continuous),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    try:
        finished = await run_to_completion(gen, request.receive)
    except Exception as exc:   # noqa: BLE001
        raise api_error_from(exc) from None
    if not finished:
        return Response(status_code=499)   # the client is gone; nobody reads this
    if state.engine.shutting_down and any(c.finish_reason == "abort" for c in gen.choices):
        # Nothing of the answer was sent yet: a 503 lets a router in front of replicas retry it on another one
        # (a 200 cut short with finish_reason "abort" it would pass on as it is).
        raise APIError(503, "the server is shutting down: the request was aborted before its answer was sent; "
                       "retry it", "service_unavailable_error", code="shutting_down")
    return JSONResponse(fmt.response(gen, state.model_name, token_text, want_logprobs).model_dump())


async def _tokenize(prompt_token_ids, req, tokenizer, has_text: bool = True):
    """`prompt_token_ids(req, tokenizer)` on a worker thread when there is text to tokenize: a long prompt takes
    seconds to tokenize, and on the event loop it would stall every other request and /health meanwhile. Token-id
    prompts are only copied, on the loop."""
    if not has_text:
        return prompt_token_ids(req, tokenizer)
    return await asyncio.to_thread(prompt_token_ids, req, tokenizer)


def _trace(request: Request) -> FirstTokenTrace:
    """The request's first-token trace, from StampReceived's stamp (the route's entry where it is missing)."""
    received = request.scope.get(RECEIVED)
    return FirstTokenTrace(received if received is not None else time.monotonic())


def _is_json(content_type: str | None) -> bool:
    """application/json (any parameters, such as charset) or a `+json` type."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


async def _json_body(request: Request, max_bytes: int) -> bytes:
    """The body of a POST that takes JSON, at most `max_bytes` long.

    Anything but `Content-Type: application/json` is a 415: a web page can send text/plain, a form or multipart (or
    no type at all) without a CORS preflight, so accepting those would let any page a browser opens start
    generations on a server without a key. A body over `max_bytes` is a 413, from its Content-Length before a byte
    of it is read, or as soon as a chunked body grows past it."""
    content_type = request.headers.get("content-type")
    if not _is_json(content_type):
        raise APIError(415, f"unsupported Content-Type {content_type!r}: send the body as JSON with "
                       "`Content-Type: application/json`" if content_type else
                       "missing Content-Type: send the body as JSON with `Content-Type: application/json`",
                       code="unsupported_media_type")
    length = request.headers.get("content-length")
    if length is not None and length.strip().isdigit() and int(length) > max_bytes:
        raise _too_large(max_bytes)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(max_bytes: int) -> APIError:
    return APIError(413, f"the request body is larger than {max_bytes} bytes, the server's limit "
                    "(--max-request-body-bytes)", code="request_too_large")


PARSE_ON_LOOP_BYTES = 64 * 1024   # a larger body is parsed on a worker thread (a few ms per MiB)


async def _parse_body(model: type[BaseModel], body: bytes) -> BaseModel:
    if len(body) <= PARSE_ON_LOOP_BYTES:
        return _parse(model, body)
    return await asyncio.to_thread(_parse, model, body)


def _parse(model: type[BaseModel], body: bytes) -> BaseModel:
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        if err["type"] == "json_invalid":
            raise APIError(400, f"the request body is not valid JSON: {err['msg']}") from None
        loc = ".".join(str(p) for p in err["loc"])
        bad = f" (got {err['input']!r})" if loc and not isinstance(err.get("input"), (dict, list)) else ""
        raise APIError(400, f"{loc or 'body'}: {err['msg']}{bad}", param=loc.split(".")[0] or None) from None


def _check_ready(state: ServerState) -> None:
    """503 while the model loads: a router asks again later (a 404 would tell it the endpoint does not exist)."""
    if not state.engine.ready:
        raise APIError(503, f"the model is not ready (phase {state.progress.phase})", "service_unavailable_error",
                       code="not_ready")


def _check_auth(request: Request, api_key: str | None) -> None:
    if api_key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise APIError(401, "invalid or missing API key: send `Authorization: Bearer <key>`",
                       code="invalid_api_key")


def validation_error_body(errors) -> dict:
    """A 400 for FastAPI's parameter validation, in the words _parse uses for bodies: the parameter, what was
    wrong with it and what was sent; nothing of the server's code."""
    err = errors[0] if errors else {}
    loc = [str(p) for p in err.get("loc", ()) if p not in ("query", "path", "header", "body", "cookie")]
    name = ".".join(loc)
    got = err.get("input")
    bad = f" (got {got!r})" if name and got is not None and not isinstance(got, (dict, list)) else ""
    return error_body(f"{name or 'request'}: {err.get('msg', 'invalid')}{bad}", "invalid_request_error",
                      param=loc[0] if loc else None)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        # str(exc) would show the handler's source file and line: say only which parameter was wrong, and how
        return JSONResponse(validation_error_body(exc.errors()), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), type_), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}", "internal_server_error"),
                            status_code=500)
