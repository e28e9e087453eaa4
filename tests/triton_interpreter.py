"""Run a test file's Triton checks in a child pytest with TRITON_INTERPRET=1.

Triton decides at `import triton` whether to interpret, and in a full run transformers / torch._dynamo import it
long before a kernel test module, so the interpreted checks run in a fresh process.

The child's own summary is the verdict, not the word "passed" in its output: it must report no failure or error,
at least `min_passed` passes (the file's interpreted checks, counted by its launcher), and no test skipped for
want of the interpreter (a child that did not interpret would skip every kernel check and still say "passed").
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
NOT_INTERPRETED_REASON = "runs in the TRITON_INTERPRET=1 child started by"
_COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)\b")


def interpreted_only(launcher: str):
    return pytest.mark.skipif(not INTERPRETED, reason=f"{NOT_INTERPRETED_REASON} {launcher}")


def summary_counts(stdout: str) -> dict[str, int]:
    """pytest's final summary line ("126 passed, 34 skipped in 40.1s") as {"passed": 126, "skipped": 34}; {} if the
    output has none."""
    for line in reversed(stdout.strip().splitlines()):
        line = line.strip("= ")
        if re.search(r"\bin [\d.]+s\b", line) and _COUNT.search(line):
            counts = {("error" if kind.startswith("error") else kind): int(n) for n, kind in _COUNT.findall(line)}
            return counts
    return {}


def check_child_summary(stdout: str, min_passed: int) -> dict[str, int]:
    counts = summary_counts(stdout)
    tail = stdout[-6000:]
    assert counts, f"no pytest summary line in the child's output:\n{tail}"
    assert counts.get("failed", 0) == 0 and counts.get("error", 0) == 0, f"child failures: {counts}\n{tail}"
    assert counts.get("passed", 0) >= min_passed, \
        f"the child passed {counts.get('passed', 0)} tests, expected at least {min_passed}: {counts}\n{tail}"
    unexpected = [ln for ln in stdout.splitlines() if ln.startswith("SKIPPED") and NOT_INTERPRETED_REASON in ln]
    assert not unexpected, "interpreted checks skipped in the interpreter child:\n" + "\n".join(unexpected)
    return counts


def run_file_under_interpreter(test_file: str, min_passed: int) -> dict[str, int]:
    """Run `test_file` in a TRITON_INTERPRET=1 child pytest; `min_passed` is how many of its tests must pass there
    (its interpreted checks and the torch-only ones that run everywhere)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", "-x", test_file],
        env=env, cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"interpreter child failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    return check_child_summary(proc.stdout, min_passed)
