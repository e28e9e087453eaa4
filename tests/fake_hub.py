"""A stand-in for huggingface.co on loopback: the four HTTP routes huggingface_hub's snapshot_download and
list_repo_tree use, over repos held in memory, so the online road of a Hub id (list the revision's files, choose
what to fetch, download into the cache) runs for real on a machine that reaches no Hub. Point a process at it with
HF_ENDPOINT=server.url. Every request is recorded (`server.requests`: method and path), so a test sees what was
fetched.

    GET  /api/models/ORG/NAME/revision/REV        {"id", "sha"}                        (repo_info)
    GET  /api/models/ORG/NAME/tree/REV             [{"type", "path", "size", "oid"}]   (list_repo_tree)
    HEAD /ORG/NAME/resolve/REV/PATH                X-Repo-Commit, ETag, Content-Length  (file metadata)
    GET  /ORG/NAME/resolve/REV/PATH                the bytes
"""
from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse


class FakeHub:
    def __init__(self, repos: dict[str, dict[str, dict[str, bytes]]]) -> None:
        """repos: ORG/NAME -> ref (branch name) -> path -> bytes; each ref is one commit."""
        self.repos = repos
        self.requests: list[tuple[str, str]] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:   # quiet
                pass

            def do_HEAD(self) -> None:
                hub._serve(self, body=False)

            def do_GET(self) -> None:
                hub._serve(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def commit(self, repo: str, ref: str) -> str:
        return hashlib.sha1(f"{repo}@{ref}".encode()).hexdigest()

    def _files(self, repo: str, rev: str) -> tuple[str, dict[str, bytes]] | None:
        for ref, files in self.repos.get(repo, {}).items():
            if rev in (ref, self.commit(repo, ref)):
                return self.commit(repo, ref), files
        return None

    def _serve(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlparse(h.path).path)
        self.requests.append((h.command, path))
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] in ("revision", "tree"):
            repo, kind, rev = "/".join(parts[2:4]), parts[4], parts[5]
            found = self._files(repo, rev)
            if found is None:
                return self._error(h, repo, rev)
            sha, files = found
            if kind == "revision":
                return self._json(h, {"id": repo, "sha": sha, "siblings": [{"rfilename": f} for f in files]})
            return self._json(h, [{"type": "file", "path": f, "size": len(data), "oid": _git_oid(data)}
                                  for f, data in files.items()])
        if len(parts) >= 5 and parts[2] == "resolve":
            repo, rev, file = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
            found = self._files(repo, rev)
            if found is None or file not in found[1]:
                return self._error(h, repo, rev, entry=found is not None)
            sha, files = found
            data = files[file]
            h.send_response(200)
            h.send_header("X-Repo-Commit", sha)
            h.send_header("ETag", f'"{_git_oid(data)}"')
            h.send_header("Content-Length", str(len(data)))
            h.end_headers()
            if body:
                h.wfile.write(data)
            return None
        return self._error(h, path, "")

    def _json(self, h: BaseHTTPRequestHandler, value) -> None:
        data = json.dumps(value).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(data)

    def _error(self, h: BaseHTTPRequestHandler, repo: str, rev: str, entry: bool = False) -> None:
        # the codes huggingface_hub maps to RepositoryNotFoundError / RevisionNotFoundError / EntryNotFoundError
        code = "EntryNotFound" if entry else ("RevisionNotFound" if repo in self.repos else "RepoNotFound")
        data = json.dumps({"error": f"{code}: {repo}@{rev}"}).encode()
        h.send_response(404)
        h.send_header("X-Error-Code", code)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(data)

    def __enter__(self) -> "FakeHub":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def _git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
