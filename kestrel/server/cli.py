"""`kestrel serve [MODEL]`: the OpenAI-compatible HTTP server."""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from kestrel.config import add_engine_args, config_from_args
from kestrel.errors import KestrelError


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server",
                              description="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, "
                              "/v1/chat/completions, /v1/models; /health, /metrics, /openapi.json, /docs).")
    add_engine_args(p, model_positional=True)
    http = p.add_argument_group("HTTP server")
    http.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    http.add_argument("--port", type=int, default=8000, help="port to listen on")
    http.add_argument("--api-key", default=None,
                      help="require `Authorization: Bearer KEY` on /v1/* (/health, /metrics, /version, "
                      "/openapi.json and /docs stay open) (default: $KESTREL_API_KEY, else no key)")
    http.add_argument("--max-queue", type=int, default=None,
                      help="requests waiting for their first token beyond which new ones get 503 "
                      "(default: unbounded)")
    http.add_argument("--max-request-body-bytes", type=int, default=32 * 1024 * 1024, metavar="BYTES",
                      help="a POST body larger than this is refused with 413, from its Content-Length before it "
                      "is read (default: 32 MiB)")
    http.add_argument("--stall-timeout", type=float, default=300.0,
                      help="seconds a startup phase may go without progress before it is reported stalled and "
                      "every thread's stack is logged (0: off)")
    http.add_argument("--engine-in-thread", action="store_true",
                      help="run the engine on a thread of the server process instead of its own process "
                      "(one GIL for both; the process is faster under load)")
    from kestrel.server.tool_parsers import PARSERS   # the names only; the parsers import nothing heavy
    tool = p.add_argument_group("tool calls")
    tool.add_argument("--tool-call-parser", default=None, choices=list(PARSERS), metavar="NAME",
                      help="read tool calls out of the model's text for tool_choice \"auto\" (vLLM's names): "
                      + "; ".join(f"{name}: {families}" for name, (_, families) in PARSERS.items())
                      + ". Without it a request with tools and tool_choice \"auto\" gets 400; \"required\" and "
                      "a named function work without it (the grammar shapes the output)")
    tool.add_argument("--enable-auto-tool-choice", action="store_true",
                      help="accepted for vLLM command lines; --tool-call-parser alone turns tool_choice \"auto\" on")
    logs = p.add_argument_group("logging")
    logs.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                      help="log level of the server and uvicorn")
    logs.add_argument("--disable-log-requests", action="store_true",
                      help="do not log a line per finished request (id, tokens, TTFT, duration, finish reason)")
    logs.add_argument("--disable-log-stats", action="store_true",
                      help="do not log the periodic throughput line (tok/s, running/waiting, KV cache usage)")
    logs.add_argument("--log-stats-interval", type=float, default=5.0, metavar="SECONDS",
                      help="seconds between throughput lines; a line is logged only if something happened")

def run(args: argparse.Namespace) -> int:
    from kestrel.server.app import ServerConfig, build_app
    from kestrel.server.preflight import check_before_serving
    from kestrel.server.server import KestrelServer

    if args.max_queue is not None and args.max_queue < 0:
        raise KestrelError(f"--max-queue {args.max_queue} is invalid: expected an integer >= 0")
    if args.max_request_body_bytes <= 0:
        raise KestrelError(f"--max-request-body-bytes {args.max_request_body_bytes} is invalid: expected bytes > 0")
    if not 0 < args.port < 65536:
        raise KestrelError(f"--port {args.port} is invalid: expected 1..65535")
    logging.getLogger("kestrel").setLevel(args.log_level.upper())
    if args.log_stats_interval <= 0:
        raise KestrelError(f"--log-stats-interval {args.log_stats_interval} is invalid: expected seconds > 0")
    engine_config = config_from_args(args)
    check_before_serving(engine_config)   # a bad path or config ends here, before anything listens
    if engine_config.node_rank > 0:   # tensor parallelism over nodes: this node only runs its ranks
        from kestrel.ranks.node import serve_node
        return serve_node(engine_config)
    server_config = ServerConfig(api_key=args.api_key or os.environ.get("KESTREL_API_KEY") or None,
                                 max_queue=args.max_queue, stall_timeout_s=args.stall_timeout or None,
                                 engine_in_thread=args.engine_in_thread,
                                 max_request_body_bytes=args.max_request_body_bytes,
                                 log_requests=not args.disable_log_requests,
                                 tool_call_parser=args.tool_call_parser,
                                 log_stats_interval_s=None if args.disable_log_stats else args.log_stats_interval)
    server = KestrelServer(build_app(engine_config, server_config), args.host, args.port, args.log_level)
    # uvicorn restores the previous SIGTERM handler and re-raises the signal once it has shut down; a no-op
    # handler there makes a graceful SIGTERM exit with status 0 instead of dying by the signal.
    signal.signal(signal.SIGTERM, lambda *_: None)
    server.run()
    if server.startup_failed:   # found by the engine (no memory for the KV cache, a bad weight file): said once
        print(f"error: the engine did not start: {server.startup_error}", file=sys.stderr)
        return 1
    return 0
