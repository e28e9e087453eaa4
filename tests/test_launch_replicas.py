"""`kestrel launch --replicas N`: every replica on its own port (and GPUs), all waited for, --then pointed at the
router, everything stopped afterwards — with stand-in servers (the real ones: tests/test_router_replicas.py)."""
from __future__ import annotations

import pytest

import socket
import sys
import textwrap

import psutil

import os
import subprocess
import threading

from kestrel.bench.launch import LaunchExit
from kestrel.bench.launch_cli import without_port
from kestrel.bench.replicas import ReplicaConfig, replica_command, router_command
from kestrel.bench.supervise import RestartPolicy, describe_exit
from kestrel.cli import main

# A stand-in for `kestrel serve`: /health and /v1/models on --port, its pid written where the test can find it.
REPLICA = textwrap.dedent('''
    import json, os, sys
    from http.server import BaseHTTPRequestHandler, HTTPServer
    import threading
    port = int(sys.argv[sys.argv.index("--port") + 1])
    open(os.path.join(sys.argv[1], f"{port}.pid"), "w").write(str(os.getpid()))
    if "--die-after" in sys.argv:   # a replica that crashes a while after it started serving
        threading.Timer(float(sys.argv[sys.argv.index("--die-after") + 1]), lambda: os._exit(1)).start()

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
    command = router_command(cfg, metrics_port=9100)
    assert command[1:] == ("-m", "smg", "launch", "--host", "127.0.0.1", "--port", "8000", "--worker-urls",
                           "http://127.0.0.1:8001", "http://127.0.0.1:8002", "--policy", "cache_aware",
                           "--prometheus-port", "9100", "--prometheus-host", "127.0.0.1", "--x", "1")
    own = ReplicaConfig(serve_command=("kestrel", "serve"), replicas=1, replica_port=8001, router="smg",
                        router_port=8000, router_args=("--prometheus-port=7000",))
    assert "9100" not in router_command(own, metrics_port=9100)   # a --router-arg of the user's own wins
    cpu = ReplicaConfig(serve_command=("kestrel", "serve"), replicas=2, replica_port=9000, router="sglang-router",
                        router_port=8999)
    assert replica_command(cpu, 0)[1] == {}
    assert router_command(cpu)[1:3] == ("-m", "sglang_router.launch_router")
    assert without_port(["kestrel", "serve", "--port", "7", "--port=8", "--portable"]) == \
        ["kestrel", "serve", "--portable"]


def _run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kestrel.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=os.getcwd())


def test_a_server_command_not_on_path_is_one_error_line_and_exit_2(tmp_path):
    env = dict(os.environ, PATH=str(tmp_path), PYTHONPATH=os.pathsep.join(sys.path))   # no `kestrel` there
    res = _run_cli("launch", "--replicas", "2", "--", "kestrel", "serve", env=env)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "error: server command 'kestrel' not found on PATH (activate the environment it is installed in, or "
        "give its full path)"]
    res = _run_cli("launch", "--", str(tmp_path / "nothing-here"), env=env)   # the single-server launch too
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr


def test_a_port_in_use_is_one_error_line(tmp_path, capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code = main(["launch", "--replicas", "2", "--router", "none", "--port", str(port - 1), "--log-file",
                     str(tmp_path / "logs" / "x.log"), "--", sys.executable, "-c", "pass"])
    assert code == 2
    assert f"port {port} for replica 0 is in use" in capsys.readouterr().err


def test_restart_backoff_doubles_up_to_its_cap():
    policy = RestartPolicy(backoff_s=1, backoff_max_s=30)
    assert [policy.delay(n) for n in range(1, 8)] == [1, 2, 4, 8, 16, 30, 30]
    assert describe_exit(-9) == "killed by SIGKILL" and describe_exit(3) == "exit code 3"


@pytest.mark.slow
def test_a_crash_looping_replica_is_restarted_while_the_other_serves(tmp_path, capsys):
    """Replica 1 dies 2 s after each start: restarted with backoff, logged, and the launch goes on (--then
    finishes, exit 0) because replica 0 still serves."""
    script = tmp_path / "replica.py"
    script.write_text(REPLICA)
    base = free_base(3)
    # --die-after only for replica 1: its port is base + 2
    wrapper = tmp_path / "wrapper.py"
    wrapper.write_text(textwrap.dedent(f'''
        import os, sys
        args = sys.argv[1:]
        if args[args.index("--port") + 1] == "{base + 2}":
            args += ["--die-after", "2"]
        os.execv(sys.executable, [sys.executable, {str(script)!r}, *args])
    '''))
    code = main(["launch", "--replicas", "2", "--router", "none", "--port", str(base), "--log-file",
                 str(tmp_path / "logs" / "x.log"), "--grace", "1", "--then", "sleep 7",
                 "--", sys.executable, str(wrapper), str(tmp_path)])
    err = capsys.readouterr().err
    assert code == LaunchExit.READY, err
    assert "replica 1: died (exit code 1) after 2 s up; 1 death(s) in the last 300 s; restart 1 in 1 s" in err
    assert "replica 1: restart 1 (pid" in err and "replica 1: back at" in err
    assert "replica 0: died" not in err
    log = (next((tmp_path / "logs").glob("replica1-*.log"))).read_text()
    assert "restart 1 (pid" in log


@pytest.mark.slow
def test_the_launch_gives_up_when_every_replica_keeps_dying(tmp_path, capsys):
    script = tmp_path / "replica.py"
    script.write_text(REPLICA)
    code = main(["launch", "--replicas", "2", "--router", "none", "--port", str(free_base(3)), "--log-file",
                 str(tmp_path / "logs" / "x.log"), "--grace", "1", "--max-restarts", "1", "--then", "sleep 60",
                 "--", sys.executable, str(script), str(tmp_path), "--die-after", "1.5"])
    err = capsys.readouterr().err
    assert code == LaunchExit.CRASHED, err
    assert "giving up: every replica died more than 1 time(s) within 300 s" in err
    assert "restart 1 in 1 s" in err and "restart 2 in 2 s" in err


@pytest.mark.slow
def test_two_launches_on_one_host_both_serve(tmp_path):
    """Two `kestrel launch --replicas 2` with smg at once: the routers' metrics ports are chosen free (smg's
    default 29000 would make the second router fail), so both serve; no httpx INFO line while they wait."""
    from tests.test_router_replicas import smg_problem

    if problem := smg_problem():
        pytest.skip(problem)
    script = tmp_path / "replica.py"
    script.write_text(REPLICA)
    procs = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        then = f"sleep 3; {sys.executable} -c \"import httpx, os; " \
               "assert httpx.get(os.environ['KESTREL_BASE_URL'] + '/v1/models').json()['data']\""
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "kestrel.cli", "launch", "--replicas", "2", "--port", str(free_base(3)),
             "--log-file", str(tmp_path / name / "logs" / "x.log"), "--then", then, "--",
             sys.executable, str(script), str(tmp_path / name)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        assert "router ready" in err and "--prometheus-port" in err
        assert "HTTP Request:" not in err


@pytest.mark.slow
def test_a_killed_router_is_restarted_behind_the_same_port(tmp_path):
    """SIGKILL smg: the launcher starts it again on its port with the same replicas; the launch's --port (the
    relay) answers again without the client changing anything."""
    import re
    import signal
    import time

    import httpx

    from tests.test_router_replicas import smg_problem

    if problem := smg_problem():
        pytest.skip(problem)
    script = tmp_path / "replica.py"
    script.write_text(REPLICA)
    base = free_base(3)
    err_path = tmp_path / "launch.err"
    proc = subprocess.Popen([sys.executable, "-m", "kestrel.cli", "launch", "--replicas", "2", "--port", str(base),
                             "--log-file", str(tmp_path / "logs" / "x.log"), "--grace", "2", "--",
                             sys.executable, str(script), str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=open(err_path, "w"))

    def wait_for(pattern: str, timeout_s: float = 60) -> re.Match:
        deadline = time.monotonic() + timeout_s
        while not (found := re.search(pattern, err_path.read_text())):
            assert proc.poll() is None and time.monotonic() < deadline, err_path.read_text()
            time.sleep(0.2)
        return found

    try:
        router_pid = int(wait_for(r"\[launch\] router \(pid (\d+)\)").group(1))
        wait_for(r"relays to the router")
        assert httpx.get(f"http://127.0.0.1:{base}/v1/models", timeout=10).json()["data"]
        os.kill(router_pid, signal.SIGKILL)
        wait_for(r"the router: died \(killed by SIGKILL\)")
        wait_for(r"the router: back at")
        assert httpx.get(f"http://127.0.0.1:{base}/v1/models", timeout=10).json()["data"]
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, err_path.read_text()
