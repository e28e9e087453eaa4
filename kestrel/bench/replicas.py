"""`kestrel launch --replicas N`: N copies of a server command (one per GPU group, or N ports on the CPU) behind a
router (smg or sglang-router), all started, all waited for, all stopped.

    client ─► router :PORT ──┬─► replica 0 :REPLICA_PORT      CUDA_VISIBLE_DEVICES=0..k-1   (k = --gpus-per-replica)
      (kestrel bench,        ├─► replica 1 :REPLICA_PORT+1    CUDA_VISIBLE_DEVICES=k..2k-1
       --then)               └─► ...

Each replica and the router is a `ServerProcess` (its own process group and log file). Readiness: every replica's
/health, then the router's view — smg's /readiness counts healthy workers; a router without it is ready when its
/v1/models answers. Stopping goes router first (no new requests reach a replica that is going away), then the
replicas, each SIGTERM then SIGKILL after the grace period.
"""
from __future__ import annotations

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

from kestrel.bench.launch import LaunchConfig, LaunchExit, ServerProcess, wait_until_ready
from kestrel.envs import child_environment

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


def replica_command(cfg: ReplicaConfig, index: int) -> tuple[tuple[str, ...], dict[str, str]]:
    """Replica `index`'s command line and extra environment (its GPUs)."""
    command = (*cfg.serve_command, "--host", cfg.host, "--port", str(cfg.replica_port + index))
    if cfg.gpus_per_replica <= 0:
        return command, {}
    first = index * cfg.gpus_per_replica
    gpus = ",".join(str(g) for g in range(first, first + cfg.gpus_per_replica))
    return command, {"CUDA_VISIBLE_DEVICES": gpus}


def router_command(cfg: ReplicaConfig) -> tuple[str, ...]:
    """smg: `python -m smg launch`; sglang-router: `python -m sglang_router.launch_router` (the same flags). By
    module, not by the `smg` command: sglang-router installs an `smg` command of its own, which wins when it is
    installed last."""
    if cfg.router == "smg":
        head: tuple[str, ...] = (sys.executable, "-m", "smg", "launch")
    else:
        head = (sys.executable, "-m", "sglang_router.launch_router")
    return (*head, "--host", cfg.host, "--port", str(cfg.router_port), "--worker-urls", *cfg.replica_urls,
            "--policy", cfg.policy, *cfg.router_args)


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


class ReplicaSet:
    """Start with `start()` (returns a LaunchExit), stop with `stop()`; also a context manager."""

    def __init__(self, cfg: ReplicaConfig, out: TextIO | None = None) -> None:
        self.cfg = cfg
        self.out = out or sys.stderr
        self.replicas: list[ServerProcess] = []
        self.router: ServerProcess | None = None
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self._log = lambda name: str(Path(cfg.log_dir) / f"{name}-{stamp}.log")

    def start(self) -> LaunchExit:
        cfg = self.cfg
        for i in range(cfg.replicas):
            command, env = replica_command(cfg, i)
            self.replicas.append(ServerProcess(command, self._log(f"replica{i}"), echo=None, env=env))
            gpus = f" on GPUs {env['CUDA_VISIBLE_DEVICES']}" if env else ""
            print(f"[launch] replica {i}{gpus}: {' '.join(command)} (log: {self.replicas[-1].log_file})",
                  file=self.out)
        for i, (replica, url) in enumerate(zip(self.replicas, cfg.replica_urls)):
            outcome = wait_until_ready(replica, self._launch_config(url), self.out)
            if outcome is not LaunchExit.READY:
                print(f"[launch] replica {i} did not become ready: {outcome.name}", file=self.out)
                return outcome
        if cfg.router == "none":
            return LaunchExit.READY
        command = router_command(cfg)
        print(f"[launch] router: {' '.join(command)}", file=self.out)
        self.router = ServerProcess(command, self._log(f"router-{cfg.router}"), echo=None)
        return self.wait_router(cfg.replicas)

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
            if router_healthy_workers(self.cfg.router_url) == healthy:
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
        command, env = replica_command(self.cfg, index)
        self.replicas[index] = ServerProcess(command, self._log(f"replica{index}-restart"), echo=None, env=env)
        return wait_until_ready(self.replicas[index], self._launch_config(self.cfg.replica_urls[index]), self.out)

    def stop(self) -> None:
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


def launch_replicas(cfg: ReplicaConfig, then: str | None, out: TextIO | None = None) -> LaunchExit:
    """`kestrel launch --replicas N`: start everything, run `then` against the router (else serve until Ctrl-C
    / SIGTERM or until something exits), and always stop everything."""
    from kestrel.bench.launch import _raise_terminated, _Terminated

    out = out or sys.stderr
    replica_set = ReplicaSet(cfg, out)
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_terminated) if in_main else None
    try:
        outcome = replica_set.start()
        if outcome is not LaunchExit.READY:
            return outcome
        if then:
            command = then.replace("{base_url}", replica_set.url).replace("{replica_urls}",
                                                                          ",".join(cfg.replica_urls))
            print(f"[launch] running: {command}", file=out)
            out.flush()
            code = subprocess.call(command, shell=True, env=child_environment(KESTREL_BASE_URL=replica_set.url))
            print(f"[launch] --then exited with code {code}", file=out)
            return LaunchExit.READY if code == 0 else LaunchExit.THEN_FAILED
        while (gone := replica_set.exited()) is None:   # serve in the foreground
            time.sleep(0.5)
        print(f"[launch] {gone} exited", file=out)
        return LaunchExit.CRASHED
    except (KeyboardInterrupt, _Terminated):
        print("[launch] interrupted: stopping the router and the replicas", file=out)
        return LaunchExit.READY
    finally:
        replica_set.stop()
        if in_main:
            signal.signal(signal.SIGTERM, previous)
