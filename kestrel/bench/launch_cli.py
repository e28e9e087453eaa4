"""`kestrel launch [options] -- <server command...>`: start any server, wait until it is ready, watch it."""
from __future__ import annotations

import argparse
import datetime
import re
from pathlib import Path

from kestrel.bench.launch import LaunchConfig, LaunchExit, launch
from kestrel.errors import KestrelError

EPILOG = "exit codes: " + ", ".join(f"{e.value} {e.name.lower().replace('_', ' ')}" for e in LaunchExit) + \
         ", 2 usage error"


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("launch", help="start a server command, wait until ready, optionally run a command",
                              epilog=EPILOG)
    p.add_argument("--name", help="used for the log file name (default: the command's program name)")
    p.add_argument("--host", default="127.0.0.1", help="where to probe readiness")
    p.add_argument("--port", type=int, help="default: the command's --port, else 8000")
    p.add_argument("--ready-timeout", type=float, default=1800.0, help="seconds until giving up (exit 5)")
    p.add_argument("--stall-timeout", type=float, default=300.0,
                   help="seconds without a log line or /health progress that count as stalled (exit 4)")
    p.add_argument("--then", help="command to run once ready ({base_url} and $KESTREL_BASE_URL are set); the "
                                  "server is stopped afterwards")
    p.add_argument("--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL")
    p.add_argument("--log-file", help="default: logs/NAME-TIMESTAMP.log")
    p.add_argument("--status-interval", type=float, default=10.0, help="seconds between status lines")
    p.add_argument("server_command", nargs=argparse.REMAINDER, help="-- then the server command")


def command_port(command: list[str]) -> int | None:
    for i, word in enumerate(command):
        if word == "--port" and i + 1 < len(command) and command[i + 1].isdigit():
            return int(command[i + 1])
        if m := re.fullmatch(r"--port=(\d+)", word):
            return int(m.group(1))
    return None


def run(args: argparse.Namespace) -> int:
    command = list(args.server_command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise KestrelError("no server command: expected `kestrel launch [options] -- <server command...>`")
    if args.ready_timeout <= 0 or args.stall_timeout <= 0:
        raise KestrelError(f"--ready-timeout {args.ready_timeout} / --stall-timeout {args.stall_timeout} are "
                           "invalid: expected seconds > 0")
    name = args.name or Path(command[0]).name
    port = args.port or command_port(command) or 8000
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    cfg = LaunchConfig(command=tuple(command), base_url=f"http://{args.host}:{port}",
                       log_file=args.log_file or f"logs/{name}-{stamp}.log", ready_timeout_s=args.ready_timeout,
                       stall_timeout_s=args.stall_timeout, then=args.then, grace_s=args.grace,
                       status_interval_s=args.status_interval)
    try:
        return int(launch(cfg))
    except FileNotFoundError as exc:
        raise KestrelError(f"server command {command[0]!r} cannot be started: {exc}") from exc
