"""`kestrel launch --replicas N`: every replica on its own port (and GPUs), all waited for, --then pointed at the
router, everything stopped afterwards — with stand-in servers (the real ones: tests/test_router_replicas.py)."""
from __future__ import annotations

import pytest

import socket
import sys
import textwrap

import psutil

from kestrel.bench.launch import LaunchExit
from kestrel.bench.launch_cli import without_port
from kestrel.bench.replicas import ReplicaConfig, replica_command, router_command
from kestrel.cli import main

# A stand-in for `kestrel serve`: /health and /v1/models on --port, its pid written where the test can find it.
REPLICA = textwrap.dedent('''
    import json, os, sys
    from http.server import BaseHTTPRequestHandler, HTTPServer
    port = int(sys.argv[sys.argv.index("--port") + 1])
    open(os.path.join(sys.argv[1], f"{port}.pid"), "w").write(str(os.getpid()))

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            body = json.dumps({"object": "list", "data": [{"id": "m"}]}).encode()
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    HTTPServer(("127.0.0.1", port), Handler).serve_forever()
''')


def free_base(n: int) -> int:
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        try:
            for port in range(base, base + n):
                with socket.socket() as t:
                    t.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError("no free ports")


@pytest.mark.slow
def test_replicas_start_on_their_own_ports_run_then_and_all_stop(tmp_path):
    script = tmp_path / "replica.py"
    script.write_text(REPLICA)
    base = free_base(4)
    seen = tmp_path / "seen.txt"
    code = main(["launch", "--replicas", "3", "--router", "none", "--port", str(base), "--log-file",
                 str(tmp_path / "logs" / "x.log"), "--then", f"echo {{base_url}} {{replica_urls}} > {seen}",
                 "--", sys.executable, str(script), str(tmp_path), "--port", "9999"])
    assert code == LaunchExit.READY
    urls = [f"http://127.0.0.1:{base + 1 + i}" for i in range(3)]
    assert seen.read_text().split() == [urls[0], ",".join(urls)]   # no router: the first replica
    pids = [int((tmp_path / f"{base + 1 + i}.pid").read_text()) for i in range(3)]
    assert not (tmp_path / "9999.pid").exists()                     # the command's own --port was replaced
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert len(list((tmp_path / "logs").glob("replica*.log"))) == 3


@pytest.mark.slow
def test_a_replica_that_crashes_stops_the_launch_and_the_others(tmp_path):
    script = tmp_path / "replica.py"
    script.write_text("import sys; sys.exit(3)")
    code = main(["launch", "--replicas", "2", "--router", "none", "--port", str(free_base(3)), "--log-file",
                 str(tmp_path / "logs" / "x.log"), "--then", "true", "--", sys.executable, str(script)])
    assert code == LaunchExit.CRASHED


def test_replica_commands_pin_gpu_groups_and_the_router_names_every_replica():
    cfg = ReplicaConfig(serve_command=("kestrel", "serve", "m"), replicas=2, replica_port=8001, router="smg",
                        router_port=8000, policy="cache_aware", gpus_per_replica=2, router_args=("--x", "1"))
    assert replica_command(cfg, 1) == (("kestrel", "serve", "m", "--host", "127.0.0.1", "--port", "8002"),
                                       {"CUDA_VISIBLE_DEVICES": "2,3"})
    command = router_command(cfg)
    assert command[1:] == ("-m", "smg", "launch", "--host", "127.0.0.1", "--port", "8000", "--worker-urls",
                           "http://127.0.0.1:8001", "http://127.0.0.1:8002", "--policy", "cache_aware", "--x", "1")
    cpu = ReplicaConfig(serve_command=("kestrel", "serve"), replicas=2, replica_port=9000, router="sglang-router",
                        router_port=8999)
    assert replica_command(cpu, 0)[1] == {}
    assert router_command(cpu)[1:3] == ("-m", "sglang_router.launch_router")
    assert without_port(["kestrel", "serve", "--port", "7", "--port=8", "--portable"]) == \
        ["kestrel", "serve", "--portable"]
