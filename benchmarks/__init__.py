"""Reproducible measurement scripts (each writes its figures as JSON). What the scripts share lives here."""
from __future__ import annotations

import json


def write_json(path: str | None, data) -> None:
    """A benchmark's results as indented JSON at `path` (--out); nothing when no path was given."""
    if path:
        with open(path, "w") as f:
            json.dump(data, f, indent=1)
