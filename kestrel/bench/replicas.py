"""`kestrel launch --replicas N`: N copies of a server command (one per GPU group, or N ports on the CPU) behind a
router (smg or sglang-router), all started, all waited for, all stopped.

    client ─► router :PORT ──┬─► replica 0 :REPLICA_PORT      CUDA_VISIBLE_DEVICES=0..k-1   (k = --gpus-per-replica)
      (kestrel bench,        ├─► replica 1 :REPLICA_PORT+1    CUDA_VISIBLE_DEVICES=k..2k-1
       --then)               └─► ...

Each replica and the router is a `ServerProcess` (its own process group and log file). Readiness: every replica's
/health, then the router's view — smg's /readiness counts healthy workers; a router without it is ready when its
/v1/models answers. Stopping goes router first (no new requests reach a replica that is going away), then the
replicas, each SIGTERM then SIGKILL after the grace period.

Once everything is ready, a replica or router that dies is restarted (kestrel/bench/supervise.py); before that, a
failure ends the launch (a replica that cannot start is a configuration to fix, not a crash to retry).
"""
from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import httpx

from kestrel.bench.front import ModelFillingRelay
from kestrel.bench.launch import LaunchConfig, LaunchExit, ServerProcess, check_program, wait_until_ready
from kestrel.bench.supervise import Member, RestartPolicy, Supervisor
from kestrel.envs import child_environment
from kestrel.errors import KestrelError

ROUTERS = ("smg", "sglang-router", "none")


@dataclass(frozen=True, slots=True)
class ReplicaConfig:
    serve_command: tuple[str, ...]     # the server command without --port (added per replica)
    replicas: int
    replica_port: int                  # replica i listens on replica_port + i
    router: str                        # one of ROUTERS
    router_port: int
    policy: str = "cache_aware"
    router_args: tuple[str, ...] = ()  # passed to the router as they are
    gpus_per_replica: int = 0          # 0: no CUDA_VISIBLE_DEVICES (CPU, or one GPU group shared)
    host: str = "127.0.0.1"
    log_dir: str = "logs"
    ready_timeout_s: float = 1800.0
    stall_timeout_s: float = 300.0
    grace_s: float = 10.0
    restart: RestartPolicy = RestartPolicy()
    router_metrics_port: int | None = None   # the router's Prometheus port; None: a free one
    fill_model: bool = True            # a relay on router_port gives model-less requests the served name (front.py)

    @property
    def replica_urls(self) -> list[str]:
        return [f"http://{self.host}:{self.replica_port + i}" for i in range(self.replicas)]

    @property
    def router_url(self) -> str:
        return f"http://{self.host}:{self.router_port}"


def free_port_block(n: int) -> int:
    """A base port with n consecutive free ports from it (the router's, then the replicas'), on loopback."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n >= 65535:
            continue
        socks: list[socket.socket] = []
        try:
            for port in range(base, base + n):
                socks.append(socket.socket())
                socks[-1].bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError("no block of free ports")


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the OS picks it; smg refuses port 0 itself)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_in_use(host: str, port: int) -> bool:
    """Something listens there. SO_REUSEADDR, as the servers themselves bind: a port that only has connections in
    TIME_WAIT (a launch stopped a moment ago) is free to them, and so to this check."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def _has_flag(args: tuple[str, ...], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def check_startable(cfg: ReplicaConfig) -> None:
    """Before starting anything: the server command and the router exist, and every port is free — one error
    line each, not a traceback from the middle of a half-started fleet."""
    check_program(cfg.serve_command[0])
    module = {"smg": "smg", "sglang-router": "sglang_router"}.get(cfg.router)
    if module and importlib.util.find_spec(module) is None:
        package = "smg==1.13.0" if cfg.router == "smg" else "sglang-router"
        raise KestrelError(f"--router {cfg.router} is not installed in {sys.executable}: pip install {package} "
                           "(or --router none)")
    ports = [(f"replica {i}", cfg.replica_port + i) for i in range(cfg.replicas)]
    if cfg.router != "none":
        ports.insert(0, ("the router (--port)", cfg.router_port))
        if cfg.router_metrics_port is not None:
            ports.append(("the router's metrics (--router-metrics-port)", cfg.router_metrics_port))
    for what, port in ports:
        if port_in_use(cfg.host, port):
            raise KestrelError(f"port {port} for {what} is in use on {cfg.host}: pick another --port / "
                               "--replica-port (replica i listens on --replica-port + i)")


def replica_command(cfg: ReplicaConfig, index: int) -> tuple[tuple[str, ...], dict[str, str]]:
    """Replica `index`'s command line and extra environment (its GPUs)."""
    command = (*cfg.serve_command, "--host", cfg.host, "--port", str(cfg.replica_port + index))
    if cfg.gpus_per_replica <= 0:
        return command, {}
    first = index * cfg.gpus_per_replica
    gpus = ",".join(str(g) for g in range(first, first + cfg.gpus_per_replica))
    return command, {"CUDA_VISIBLE_DEVICES": gpus}


def router_command(cfg: ReplicaConfig, metrics_port: int | None = None, port: int | None = None) -> tuple[str, ...]:
    """smg: `python -m smg launch`; sglang-router: `python -m sglang_router.launch_router` (the same flags). By
    module, not by the `smg` command: sglang-router installs an `smg` command of its own, which wins when it is
    installed last.

    Its Prometheus listener (both default to 0.0.0.0:29000, so a second launch on the host would fail) goes on
    --host at `metrics_port`, unless --router-arg names its own. `port`: where it listens, when not on
    cfg.router_port (behind the model-filling relay)."""
    if cfg.router == "smg":
        head: tuple[str, ...] = (sys.executable, "-m", "smg", "launch")
    else:
        head = (sys.executable, "-m", "sglang_router.launch_router")
    metrics: tuple[str, ...] = ()
    if metrics_port is not None and not _has_flag(cfg.router_args, "--prometheus-port"):
        metrics = ("--prometheus-port", str(metrics_port))
        if not _has_flag(cfg.router_args, "--prometheus-host"):
            metrics += ("--prometheus-host", cfg.host)
    return (*head, "--host", cfg.host, "--port", str(port or cfg.router_port), "--worker-urls", *cfg.replica_urls,
            "--policy", cfg.policy, *metrics, *cfg.router_args)


def served_model(replica_url: str, timeout_s: float = 10.0) -> str | None:
    """The model id a replica serves (its /v1/models), None when it names none."""
    try:
        data = httpx.get(replica_url.rstrip("/") + "/v1/models", timeout=timeout_s).json().get("data")
        return data[0]["id"] if data and isinstance(data[0], dict) and data[0].get("id") else None
    except (httpx.HTTPError, ValueError, AttributeError, KeyError, TypeError):
        return None


def router_healthy_workers(router_url: str, timeout_s: float = 2.0) -> int | None:
    """Workers the router would route to now: smg's /readiness `healthy_workers`; for a router without
    /readiness, all of its /workers list when /v1/models answers. None: the router does not answer."""
    base = router_url.rstrip("/")
    try:
        with httpx.Client(timeout=timeout_s) as client:
            resp = client.get(base + "/readiness")
            if resp.status_code in (200, 503):
                try:
                    return int(resp.json().get("healthy_workers", 0))
                except (ValueError, AttributeError, TypeError):
                    return 0
            if client.get(base + "/v1/models").status_code != 200:
                return 0
            workers = client.get(base + "/workers")
            body = workers.json() if workers.status_code == 200 else {}
            listed = body.get("workers", body.get("urls", [])) if isinstance(body, dict) else []
            return len(listed)
    except httpx.HTTPError:
        return None


def router_api_key(router_args: tuple[str, ...]) -> str | None:
    """The router's --api-key among --router-arg values, which its control plane (/workers) asks for too."""
    for i, arg in enumerate(router_args):
        if arg == "--api-key" and i + 1 < len(router_args):
            return router_args[i + 1]
        if arg.startswith("--api-key="):
            return arg.split("=", 1)[1]
    return None


def reregister_worker(router_url: str, worker_url: str, api_key: str | None = None,
                      timeout_s: float = 30.0) -> str | None:
    """Register `worker_url` with smg afresh: DELETE /workers/{id} (queued; wait until it is gone), then POST
    /workers (queued too; wait until it is listed healthy) — a new worker entry, its circuit breaker closed and its
    health fresh. Returns an error, or None."""
    base = router_url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.monotonic() + timeout_s
    try:
        with httpx.Client(timeout=10, headers=headers) as client:
            while True:
                resp = client.get(base + "/workers")
                resp.raise_for_status()
                ids = [w["id"] for w in resp.json().get("workers", []) if w.get("url") == worker_url]
                if not ids:
                    break
                for worker_id in ids:
                    client.delete(f"{base}/workers/{worker_id}")
                if time.monotonic() > deadline:
                    return f"smg still lists {worker_url} {timeout_s:g} s after DELETE /workers"
                time.sleep(0.2)
            resp = client.post(base + "/workers", json={"url": worker_url})
            if resp.status_code >= 400:
                return f"POST /workers answered {resp.status_code}: {resp.text[:200]}"
            while True:   # the addition is queued too: done once smg lists the worker healthy
                listed = client.get(base + "/workers").json().get("workers", [])
                if any(w.get("url") == worker_url and w.get("is_healthy") for w in listed):
                    return None
                if time.monotonic() > deadline:
                    return f"smg did not list {worker_url} healthy {timeout_s:g} s after POST /workers"
                time.sleep(0.2)
    except (httpx.HTTPError, ValueError, KeyError, AttributeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


class ReplicaSet:
    """Start with `start()` (returns a LaunchExit), stop with `stop()`; also a context manager."""

    def __init__(self, cfg: ReplicaConfig, out: TextIO | None = None) -> None:
        self.cfg = cfg
        self.out = out or sys.stderr
        self.replicas: list[ServerProcess] = []
        self.router: ServerProcess | None = None
        self.metrics_port: int | None = None   # the router's Prometheus port, kept across its restarts
        self.router_listen_port = cfg.router_port   # another (free) port when the relay holds router_port
        self.relay: ModelFillingRelay | None = None
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self._log = lambda name: str(Path(cfg.log_dir) / f"{name}-{stamp}.log")

    def _start_replica(self, index: int, append: bool = False) -> ServerProcess:
        command, env = replica_command(self.cfg, index)
        process = ServerProcess(command, self._log(f"replica{index}"), echo=None, env=env, append=append)
        if index < len(self.replicas):
            self.replicas[index] = process
        else:
            self.replicas.append(process)
        return process

    def _start_router(self, append: bool = False) -> ServerProcess:
        self.router = ServerProcess(router_command(self.cfg, self.metrics_port, self.router_listen_port),
                                    self._log(f"router-{self.cfg.router}"), echo=None, append=append)
        return self.router

    def start(self) -> LaunchExit:
        cfg = self.cfg
        check_startable(cfg)
        for i in range(cfg.replicas):
            replica = self._start_replica(i)
            env = replica_command(cfg, i)[1]
            gpus = f" on GPUs {env['CUDA_VISIBLE_DEVICES']}" if env else ""
            print(f"[launch] replica {i}{gpus} (pid {replica.pid}): {' '.join(replica.proc.args)} "
                  f"(log: {replica.log_file})",
                  file=self.out)
        for i, (replica, url) in enumerate(zip(self.replicas, cfg.replica_urls)):
            outcome = wait_until_ready(replica, self._launch_config(url), self.out)
            if outcome is not LaunchExit.READY:
                print(f"[launch] replica {i} did not become ready: {outcome.name}", file=self.out)
                return outcome
        if cfg.router == "none":
            return LaunchExit.READY
        self.metrics_port = cfg.router_metrics_port or free_port(cfg.host)
        model = served_model(cfg.replica_urls[0]) if cfg.fill_model else None
        if model is not None:
            self.router_listen_port = free_port(cfg.host)
        router = self._start_router()
        print(f"[launch] router (pid {router.pid}): {' '.join(router.proc.args)}", file=self.out)
        outcome = self.wait_router(cfg.replicas)
        if outcome is LaunchExit.READY and model is not None:
            self.relay = ModelFillingRelay(cfg.host, cfg.router_port, cfg.host, self.router_listen_port, model)
            try:
                self.relay.start()
            except OSError as exc:   # --port taken since check_startable looked
                print(f"[launch] cannot listen on {cfg.router_url}: {exc}", file=self.out)
                return LaunchExit.CRASHED
            print(f"[launch] {cfg.router_url} relays to the router at {self.router_internal_url}, naming "
                  f"{model!r} in requests that name no model (smg requires one; --no-fill-model: the router "
                  "itself on --port)", file=self.out)
        return outcome

    @property
    def router_internal_url(self) -> str:
        """The router itself (behind the relay, when there is one)."""
        return f"http://{self.cfg.host}:{self.router_listen_port}"

    def members(self) -> list[Member]:
        """What a Supervisor watches: each replica and the router, each restartable in place."""
        # smg: a replica back from the dead is registered afresh (supervise.py says why); sglang-router has another
        # worker API (not exercised here): its own health checks have to take the replica back
        key = router_api_key(self.cfg.router_args)
        found = [Member(f"replica {i}", url, start=lambda i=i: self._start_replica(i, append=True),
                        get=lambda i=i: self.replicas[i],
                        on_back=(lambda url=url: reregister_worker(self.router_internal_url, url, key))
                        if self.router is not None and self.cfg.router == "smg" else None)
                 for i, url in enumerate(self.cfg.replica_urls)]
        if self.router is not None:
            found.append(Member("the router", self.router_internal_url, start=lambda: self._start_router(append=True),
                                get=lambda: self.router, is_replica=False))
        return found

    def wait_router(self, healthy: int, timeout_s: float | None = None) -> LaunchExit:
        """Wait until the router routes to `healthy` replicas (its own health checks decide)."""
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self.cfg.ready_timeout_s)
        while time.monotonic() < deadline:
            if self.router.exited() is not None:
                self.router.drain()
                print(f"[launch] the router exited with code {self.router.exited()}; its last lines:",
                      file=self.out)
                for line in list(self.router.last_lines)[-15:]:
                    print(line, file=self.out)
                return LaunchExit.CRASHED
            if router_healthy_workers(self.router_internal_url) == healthy:
                print(f"[launch] router ready at {self.cfg.router_url} with {healthy} replica(s)", file=self.out)
                return LaunchExit.READY
            time.sleep(0.25)
        return LaunchExit.TIMED_OUT

    def _launch_config(self, url: str) -> LaunchConfig:
        return LaunchConfig(command=(), base_url=url, log_file="", ready_timeout_s=self.cfg.ready_timeout_s,
                            stall_timeout_s=self.cfg.stall_timeout_s, grace_s=self.cfg.grace_s)

    @property
    def url(self) -> str:
        """Where clients go: the router, or the first replica without one."""
        return self.cfg.router_url if self.cfg.router != "none" else self.cfg.replica_urls[0]

    def exited(self) -> str | None:
        """What has exited on its own, if anything."""
        if self.router is not None and self.router.exited() is not None:
            return f"the router (code {self.router.exited()})"
        for i, replica in enumerate(self.replicas):
            if replica.exited() is not None:
                return f"replica {i} (code {replica.exited()})"
        return None

    def stop_replica(self, index: int) -> None:
        self.replicas[index].stop(self.cfg.grace_s)

    def restart_replica(self, index: int) -> LaunchExit:
        """Start replica `index` again on its port (after `stop_replica`) and wait for its /health."""
        self._start_replica(index, append=True)
        return wait_until_ready(self.replicas[index], self._launch_config(self.cfg.replica_urls[index]), self.out)

    def stop(self) -> None:
        if self.router is None and not self.replicas:
            return   # nothing was started (e.g. check_startable refused)
        if self.relay is not None:
            self.relay.stop()
        if self.router is not None:
            self.router.stop(self.cfg.grace_s)
        for replica in self.replicas:
            replica.stop(self.cfg.grace_s)
        print(f"[launch] stopped the router and {len(self.replicas)} replica(s)", file=self.out)

    def __enter__(self) -> ReplicaSet:
        outcome = self.start()
        if outcome is not LaunchExit.READY:
            self.stop()
            raise RuntimeError(f"the replicas did not start: {outcome.name}")
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def launch_replicas(cfg: ReplicaConfig, then: str | None, out: TextIO | None = None,
                    tick_s: float = 0.25) -> LaunchExit:
    """`kestrel launch --replicas N`: start everything, run `then` against the router (else serve until Ctrl-C /
    SIGTERM), restarting whatever dies meanwhile; end when every replica keeps dying; always stop everything."""
    from kestrel.bench.launch import _raise_terminated, _Terminated

    out = out or sys.stderr
    replica_set = ReplicaSet(cfg, out)
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_terminated) if in_main else None
    then_proc: subprocess.Popen | None = None
    try:
        outcome = replica_set.start()
        if outcome is not LaunchExit.READY:
            return outcome
        if then:
            command = then.replace("{base_url}", replica_set.url).replace("{replica_urls}",
                                                                          ",".join(cfg.replica_urls))
            print(f"[launch] running: {command}", file=out)
            out.flush()
            then_proc = subprocess.Popen(command, shell=True, start_new_session=True,
                                         env=child_environment(KESTREL_BASE_URL=replica_set.url))
        else:
            print(f"[launch] serving at {replica_set.url} until Ctrl-C or SIGTERM; a replica that dies is "
                  f"restarted (gives up after {cfg.restart.max_restarts} restart(s) of every replica within "
                  f"{cfg.restart.window_s:g} s)", file=out)
            out.flush()
        supervisor = Supervisor(replica_set.members(), cfg.restart, out, cfg.ready_timeout_s, cfg.grace_s)
        while True:
            if then_proc is not None and (code := then_proc.poll()) is not None:
                print(f"[launch] --then exited with code {code}", file=out)
                return LaunchExit.READY if code == 0 else LaunchExit.THEN_FAILED
            if (outcome := supervisor.tick()) is not None:
                return outcome
            time.sleep(tick_s)
    except (KeyboardInterrupt, _Terminated):
        print("[launch] interrupted: stopping the router and the replicas", file=out)
        return LaunchExit.READY
    finally:
        if then_proc is not None and then_proc.poll() is None:
            os.killpg(then_proc.pid, signal.SIGTERM)
            then_proc.wait()
        replica_set.stop()
        if in_main:
            signal.signal(signal.SIGTERM, previous)
