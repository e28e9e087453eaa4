"""The lab (lab/: device-call scripts, run logs, results JSON) stays apart from the product: no product file imports
or runs it, and the product tree does not talk about device-call plumbing."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ["kestrel", "benchmarks", "tests", "docs"]


def _files():
    for top in PRODUCT:
        for path in (ROOT / top).rglob("*"):
            if path.is_file() and path.suffix in (".py", ".md", ".sh", ".cu", ".cuh") and path.name != Path(__file__).name:
                yield path
    yield ROOT / "README.md"


def test_no_product_file_imports_or_runs_lab_code():
    pattern = re.compile(r"^\s*(from lab\b|import lab\b)|lab/scripts/|python3? -m lab\.", re.M)
    offenders = [str(p.relative_to(ROOT)) for p in _files() if pattern.search(p.read_text(errors="replace"))]
    assert offenders == []


def test_the_product_tree_does_not_talk_about_device_calls():
    pattern = re.compile(r"device call|\.whl-lite|benchmarks/results|\$OUT\b|scripts/gpu_suite", re.I)
    offenders = [str(p.relative_to(ROOT)) for p in _files() if pattern.search(p.read_text(errors="replace"))]
    assert offenders == []
