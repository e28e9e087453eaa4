"""A Hugging Face cache written the way huggingface_hub writes one, for tests on machines that reach no Hub.

    CACHE/models--ORG--NAME/
        blobs/<etag>                      each file's bytes once: LFS files (weights) under their sha256, the others
                                          under their git blob sha1, as the Hub's ETag names them
        refs/<branch or tag>              the commit the ref points at (40 hex, no newline)
        snapshots/<commit>/<path>         relative symlinks ../../blobs/<etag>, one tree per commit

tests/test_hub_models.py checks that huggingface_hub's own scan_cache_dir and try_to_load_from_cache read it.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

LFS_SUFFIXES = (".safetensors", ".gguf", ".bin")


def _etag(path: str, data: bytes) -> str:
    if path.endswith(LFS_SUFFIXES):
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()   # git's blob id


def add_snapshot(cache: Path, repo_id: str, files: Path | dict[str, bytes], refs: tuple[str, ...] = ("main",),
                 commit: str | None = None) -> Path:
    """Put `files` (a directory's files, or path -> bytes) into `cache` as commit `commit` of `repo_id` (default:
    a hash of the content), point each of `refs` at it, and return the snapshot directory."""
    if isinstance(files, Path):
        files = {p.relative_to(files).as_posix(): p.read_bytes() for p in sorted(files.rglob("*")) if p.is_file()}
    commit = commit or hashlib.sha1(repr(sorted((k, _etag(k, v)) for k, v in files.items())).encode()
                                    + repo_id.encode()).hexdigest()
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    for rel, data in files.items():
        blob = repo / "blobs" / _etag(rel, data)
        if not blob.exists():
            blob.write_bytes(data)
        link = snapshot / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.is_symlink():
            link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot
