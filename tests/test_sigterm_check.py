"""benchmarks/sigterm_check.py against the real `kestrel serve --tensor-parallel-size 2` on the CPU: the server is
found ready with its worker rank, a SIGTERM sent while a long request decodes (its 237 tokens take seconds here)
ends it with status 0 within the limit, and nothing of its process tree is left (the same check
runs on GPUs with --device cuda)."""
from __future__ import annotations

import pytest

import json
import subprocess
import sys
from pathlib import Path

from tests.test_server_startup import free_port

pytestmark = pytest.mark.slow   # a server with tensor-parallel ranks in a subprocess

ROOT = Path(__file__).resolve().parents[1]


def test_sigterm_during_a_request_at_tp2_exits_cleanly_and_leaves_no_rank(checkpoint_factory, tmp_path):
    out = tmp_path / "sigterm.json"
    run = subprocess.run([sys.executable, "-m", "benchmarks.sigterm_check", str(checkpoint_factory("llama")),
                          "--tensor-parallel-size", "2", "--device", "cpu", "--port", str(free_port()),
                          "--ready-timeout", "120", "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=200)
    result = json.loads(out.read_text())
    assert run.returncode == 0, (run.stdout, result, (tmp_path / "sigterm.log").read_text()[-3000:])
    assert result["ok"] and result["ready"] and result["workers_seen"] == 1
    assert result["exited"] and result["returncode"] == 0 and result["exit_s"] < 30
    assert result["short_request"] == 200 and result["left_behind"] == []
