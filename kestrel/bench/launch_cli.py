"""`kestrel launch [options] -- <server command...>`: start any server, wait until it is ready, watch it."""
from __future__ import annotations

import argparse
import datetime
import logging
import re
from pathlib import Path

from kestrel.bench.launch import LaunchConfig, LaunchExit, check_program, launch
from kestrel.bench.replicas import ROUTERS, ReplicaConfig, launch_replicas
from kestrel.bench.supervise import RestartPolicy
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
                                  "server is stopped afterwards (with --replicas, {base_url} is the router and "
                                  "{replica_urls} the replicas, comma-separated)")
    p.add_argument("--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL")
    p.add_argument("--log-file", help="default: logs/NAME-TIMESTAMP.log")
    p.add_argument("--status-interval", type=float, default=10.0, help="seconds between status lines")
    rep = p.add_argument_group("replicas behind a router (docs/replicas.md)")
    rep.add_argument("--replicas", type=int, default=1,
                     help="start N copies of the server command (each with its own --port) and a router in front "
                     "of them at --port; --then and the bench talk to the router")
    rep.add_argument("--router", default="smg", choices=ROUTERS,
                     help="the router: smg (`pip install smg`), sglang-router, or none (the replicas only)")
    rep.add_argument("--policy", default="cache_aware",
                     help="the router's --policy: cache_aware, round_robin, power_of_two, random, ...")
    rep.add_argument("--replica-port", type=int, default=None,
                     help="replica i listens on this port + i (default: --port + 1)")
    rep.add_argument("--gpus-per-replica", type=int, default=0,
                     help="give replica i GPUs [i*K, (i+1)*K) through CUDA_VISIBLE_DEVICES (0: no pinning, "
                     "e.g. on the CPU)")
    rep.add_argument("--router-arg", action="append", default=[], metavar="ARG",
                     help="an extra argument for the router, repeatable (e.g. --router-arg=--cache-threshold "
                     "--router-arg=0.5)")
    rep.add_argument("--router-metrics-port", type=int, default=None,
                     help="the router's Prometheus /metrics port, on --host (default: a free port; smg's own default "
                     "29000 would clash with a second launch on the host)")
    rep.add_argument("--fill-model", action=argparse.BooleanOptionalAction, default=True,
                     help="a request without `model` gets the served model's name, as `kestrel serve` treats it "
                     "(smg refuses such a request): a byte-level relay on --port in front of the router, which "
                     "then listens on a free port; --no-fill-model puts the router itself on --port")
    rep.add_argument("--max-restarts", type=int, default=5,
                     help="a replica (or the router) that dies is restarted after 1 s, 2 s, 4 s, ... (at most "
                     "--restart-backoff-max); the launch ends (exit 3) once every replica, or the router, died more "
                     "than this many times within --restart-window")
    rep.add_argument("--restart-window", type=float, default=300.0,
                     help="seconds over which deaths are counted for --max-restarts and the backoff")
    rep.add_argument("--restart-backoff-max", type=float, default=30.0,
                     help="the longest wait, in seconds, before restarting a dead replica")
    p.add_argument("server_command", nargs=argparse.REMAINDER, help="-- then the server command")


def command_port(command: list[str]) -> int | None:
    for i, word in enumerate(command):
        if word == "--port" and i + 1 < len(command) and command[i + 1].isdigit():
            return int(command[i + 1])
        if m := re.fullmatch(r"--port=(\d+)", word):
            return int(m.group(1))
    return None


def without_port(command: list[str]) -> list[str]:
    """The command less its --port (each replica gets its own)."""
    out, skip = [], False
    for word in command:
        if skip:
            skip = False
        elif word == "--port":
            skip = True
        elif not word.startswith("--port="):
            out.append(word)
    return out


def run(args: argparse.Namespace) -> int:
    command = list(args.server_command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise KestrelError("no server command: expected `kestrel launch [options] -- <server command...>`")
    if args.ready_timeout <= 0 or args.stall_timeout <= 0:
        raise KestrelError(f"--ready-timeout {args.ready_timeout} / --stall-timeout {args.stall_timeout} are "
                           "invalid: expected seconds > 0")
    check_program(command[0])
    # the launcher probes /health every half second through httpx, which logs each request at INFO
    logging.getLogger("httpx").setLevel(logging.WARNING)
    name = args.name or Path(command[0]).name
    port = args.port or command_port(command) or 8000
    if args.replicas < 1 or args.gpus_per_replica < 0:
        raise KestrelError(f"--replicas {args.replicas} / --gpus-per-replica {args.gpus_per_replica} are invalid: "
                           "expected >= 1 / >= 0")
    if args.max_restarts < 0 or args.restart_window <= 0 or args.restart_backoff_max <= 0:
        raise KestrelError(f"--max-restarts {args.max_restarts} / --restart-window {args.restart_window} / "
                           f"--restart-backoff-max {args.restart_backoff_max} are invalid: expected >= 0 / seconds "
                           "> 0 / seconds > 0")
    if args.replicas > 1 or args.router_arg:
        restart = RestartPolicy(backoff_s=min(1.0, args.restart_backoff_max),
                                backoff_max_s=args.restart_backoff_max, max_restarts=args.max_restarts,
                                window_s=args.restart_window)
        cfg = ReplicaConfig(serve_command=tuple(without_port(command)), replicas=args.replicas,
                            replica_port=args.replica_port or port + 1, router=args.router, router_port=port,
                            policy=args.policy, router_args=tuple(args.router_arg),
                            gpus_per_replica=args.gpus_per_replica, host=args.host,
                            log_dir=str(Path(args.log_file).parent) if args.log_file else "logs",
                            ready_timeout_s=args.ready_timeout, stall_timeout_s=args.stall_timeout,
                            grace_s=args.grace, restart=restart, router_metrics_port=args.router_metrics_port,
                            fill_model=args.fill_model)
        return int(launch_replicas(cfg, args.then))
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    cfg = LaunchConfig(command=tuple(command), base_url=f"http://{args.host}:{port}",
                       log_file=args.log_file or f"logs/{name}-{stamp}.log", ready_timeout_s=args.ready_timeout,
                       stall_timeout_s=args.stall_timeout, then=args.then, grace_s=args.grace,
                       status_interval_s=args.status_interval)
    try:
        return int(launch(cfg))
    except FileNotFoundError as exc:
        raise KestrelError(f"server command {command[0]!r} cannot be started: {exc}") from exc
