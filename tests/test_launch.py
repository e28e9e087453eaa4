"""`kestrel launch`: ready, slow-but-progressing, stalled, crashed, timed out — and nothing left behind."""
from __future__ import annotations

import pytest

import socket
import sys
import textwrap
from pathlib import Path

import psutil

from kestrel.bench.launch import LaunchExit
from kestrel.cli import main

SERVER = textwrap.dedent('''
    import json, os, signal, subprocess, sys, time
    from http.server import BaseHTTPRequestHandler, HTTPServer
    port, mode, pid_file = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    # a worker that ignores SIGTERM: stopping must escalate to SIGKILL for it
    child = subprocess.Popen([sys.executable, "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
    open(pid_file, "w").write(f"{os.getpid()} {child.pid}")
    print("starting", mode, flush=True)
    if mode == "crash":
        child.kill()
        sys.exit(1)
    if mode == "stall":
        print("loading weights", flush=True)
        time.sleep(600)
    if mode == "forever":
        while True:
            print("still compiling", flush=True)
            time.sleep(0.2)
    if mode == "slow":
        for i in range(6):
            time.sleep(0.3)
            print(f"loading shard {i}", flush=True)
    start = time.time()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            if mode == "kestrel" and self.path == "/health":
                # phase progress advances every 0.25 s for 1.5 s, with no log line meanwhile
                elapsed = time.time() - start
                if elapsed < 1.5:
                    body = json.dumps({"phase": "loading_weights", "progress": int(elapsed / 0.25) / 6,
                                       "elapsed_s": elapsed}).encode()
                    self.send_response(503)
                else:
                    body, _ = b'{"phase": "ready"}', self.send_response(200)
            elif self.path == "/v1/models":
                body = b'{"data": [{"id": "m"}]}'
                self.send_response(200)
            else:
                body = b"not found"
                self.send_response(404)
            self.end_headers()
            self.wfile.write(body)

    HTTPServer(("127.0.0.1", port), Handler).serve_forever()
''')


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(tmp_path: Path, mode: str, *flags: str) -> tuple[int, list[int]]:
    script, pid_file = tmp_path / "server.py", tmp_path / f"{mode}.pids"
    script.write_text(SERVER)
    port = _free_port()
    code = main(["launch", "--name", mode, "--log-file", str(tmp_path / f"{mode}.log"), "--grace", "0.5",
                 "--status-interval", "0.5", *flags, "--",
                 sys.executable, str(script), str(port), mode, str(pid_file), "--port", str(port)])
    pids = [int(p) for p in pid_file.read_text().split()] if pid_file.exists() else []
    return code, pids


def _assert_all_gone(pids: list[int]) -> None:
    assert pids, "the server never wrote its pids"
    for pid in pids:
        try:
            assert psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, f"process {pid} survived"
        except psutil.NoSuchProcess:
            pass


def test_ready_server_runs_then_with_base_url_and_is_stopped_with_its_workers(tmp_path):
    seen = tmp_path / "seen"
    then = f"{sys.executable} -c \"import os, sys; open('{seen}', 'w').write(sys.argv[1] + ' ' + " \
           "os.environ['KESTREL_BASE_URL'])\" {base_url}"
    code, pids = _launch(tmp_path, "ready", "--stall-timeout", "20", "--then", then)
    assert code == LaunchExit.READY == 0
    url = seen.read_text().split()
    assert url[0] == url[1] and url[0].startswith("http://127.0.0.1:")
    assert "starting ready" in (tmp_path / "ready.log").read_text()   # the log was teed to the file
    _assert_all_gone(pids)


def test_failing_then_command_exits_1(tmp_path):
    code, pids = _launch(tmp_path, "ready", "--then", f"{sys.executable} -c 'raise SystemExit(7)'")
    assert code == LaunchExit.THEN_FAILED == 1
    _assert_all_gone(pids)


@pytest.mark.slow
def test_slow_but_printing_server_is_not_stalled(tmp_path, capsys):
    code, pids = _launch(tmp_path, "slow", "--stall-timeout", "1.2", "--then", "true")
    assert code == LaunchExit.READY
    assert "slow but progressing" in capsys.readouterr().err
    _assert_all_gone(pids)


@pytest.mark.slow
def test_kestrel_health_progress_counts_as_activity(tmp_path, capsys):
    code, pids = _launch(tmp_path, "kestrel", "--stall-timeout", "1.0", "--then", "true")
    err = capsys.readouterr().err
    assert code == LaunchExit.READY, err
    assert "phase loading_weights" in err
    _assert_all_gone(pids)


def test_silent_server_is_stalled_with_diagnostics(tmp_path, capsys):
    code, pids = _launch(tmp_path, "stall", "--stall-timeout", "1.0")
    err = capsys.readouterr().err
    assert code == LaunchExit.STALLED == 4
    assert "STALLED" in err and "process tree" in err and "loading weights" in err
    assert str(pids[0]) in err and str(pids[1]) in err   # both processes listed with their CPU time
    _assert_all_gone(pids)


def test_crashed_server_exits_3(tmp_path, capsys):
    code, pids = _launch(tmp_path, "crash", "--stall-timeout", "20")
    assert code == LaunchExit.CRASHED == 3
    assert "exited with code 1" in capsys.readouterr().err
    _assert_all_gone(pids)


@pytest.mark.slow
def test_progressing_server_past_the_ready_timeout_exits_5(tmp_path, capsys):
    code, pids = _launch(tmp_path, "forever", "--stall-timeout", "5", "--ready-timeout", "1.5")
    assert code == LaunchExit.TIMED_OUT == 5
    assert "TIMED OUT" in capsys.readouterr().err
    _assert_all_gone(pids)


def test_missing_command_is_a_usage_error(capsys):
    assert main(["launch", "--"]) == 2
    assert "no server command" in capsys.readouterr().err


def test_waiting_prints_no_httpx_request_lines(tmp_path):
    """The launcher polls /health every half second through httpx, which logs each request at INFO: a subprocess,
    as a user runs it, with Kestrel's INFO logging on, shows none of them."""
    import os
    import subprocess

    script, pid_file = tmp_path / "server.py", tmp_path / "slow.pids"
    script.write_text(SERVER)
    port = _free_port()
    res = subprocess.run([sys.executable, "-m", "kestrel.cli", "launch", "--log-file", str(tmp_path / "x.log"),
                          "--grace", "0.5", "--then", "true", "--", sys.executable, str(script), str(port), "slow",
                          str(pid_file), "--port", str(port)],
                         capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=os.getcwd()))
    assert res.returncode == 0, res.stderr
    assert "[launch] ready at" in res.stderr
    assert "HTTP Request:" not in res.stderr and "INFO httpx" not in res.stderr, res.stderr
