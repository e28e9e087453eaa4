"""Run a test file's Triton checks in a child pytest with TRITON_INTERPRET=1.

Triton decides at `import triton` whether to interpret, and in a full run transformers / torch._dynamo import it
long before a kernel test module, so the interpreted checks run in a fresh process.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def interpreted_only(launcher: str):
    return pytest.mark.skipif(not INTERPRETED, reason=f"runs in the TRITON_INTERPRET=1 child started by {launcher}")


def run_file_under_interpreter(test_file: str) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", test_file],
        env=env, cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"interpreter child failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    assert " passed" in proc.stdout and "skipped" in proc.stdout  # the launcher itself skips in the child
