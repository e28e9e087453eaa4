"""SIGTERM to `kestrel serve --tensor-parallel-size N`: it must exit promptly and leave no process behind.

    python -m benchmarks.sigterm_check MODEL --tensor-parallel-size N [--device cuda] [--out sigterm.json]
        [-- extra kestrel serve flags]

Starts the server, waits for /health to answer 200, notes its process tree (the engine process and the N - 1
`kestrel.ranks.worker` ranks), sends one short completion, then starts a long one and sends SIGTERM while
it decodes (the hardest moment: every rank inside a step). Checks that the server exits within --exit-timeout
seconds with status 0, that every process of its tree is gone within --reap-timeout, and that no
`kestrel.ranks.worker` that was not there before is left anywhere (a pgrep over /proc). Whatever is left is
killed afterwards (it is this check's own server's), so what runs next gets the GPUs back. Exits 0 when all holds.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

WORKER = "kestrel.ranks.worker"


def process_table() -> dict[int, tuple[int, str, str]]:
    """pid -> (parent pid, start time, command line), from /proc (no psutil on the GPU hosts' bare python)."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:   # exited while we looked
            continue
        fields = stat[stat.rindex(")") + 2:].split()   # after "pid (comm) ": state ppid ... starttime (22nd field)
        table[int(entry)] = (int(fields[1]), fields[19], cmdline.strip())
    return table


def descendants(root: int, table: dict[int, tuple[int, str, str]]) -> dict[int, tuple[str, str]]:
    """root's children, grandchildren, ...: pid -> (start time, command line)."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = {}, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found[pid] = table[pid][1:]
        todo += children.get(pid, [])
    return found


def still_alive(procs: dict[int, tuple[str, str]]) -> dict[int, str]:
    """The ones of procs still running (the same start time: not a reused pid) and not zombies."""
    table = process_table()
    alive = {}
    for pid, (start, cmd) in procs.items():
        if pid in table and table[pid][1] == start:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if state != "Z":
                alive[pid] = cmd
    return alive


def worker_processes() -> dict[int, tuple[str, str]]:
    me = os.getpid()
    return {pid: (start, cmd) for pid, (_, start, cmd) in process_table().items()
            if WORKER in cmd and pid != me and "sigterm_check" not in cmd}


def http(url: str, body: dict | None = None, timeout: float = 5.0) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, json.loads(exc.read() or b"{}")
        except ValueError:
            return exc.code, {}


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float) -> tuple[bool, str]:
    deadline, last = time.monotonic() + timeout_s, "no answer"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False, f"the server exited with code {proc.returncode} before it was ready"
        try:
            status, body = http(f"{url}/health")
            if status == 200:
                return True, "ready"
            last = f"{status} {body.get('phase')}: {body.get('error') or ''}".strip()
            if body.get("phase") == "failed":
                return False, last
        except (urllib.error.URLError, OSError, ValueError):
            pass
        time.sleep(0.2)
    return False, f"not ready within {timeout_s:g} s (last /health: {last})"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--tensor-parallel-size", type=int, default=2)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--port", type=int, default=8021)
    ap.add_argument("--ready-timeout", type=float, default=240.0)
    ap.add_argument("--exit-timeout", type=float, default=30.0, help="seconds the server may take to exit")
    ap.add_argument("--reap-timeout", type=float, default=10.0, help="seconds after its exit for its processes to go")
    ap.add_argument("--log", default=None, help="the server's output (default: beside --out)")
    ap.add_argument("--out", default="sigterm.json")
    args = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    out = Path(args.out)
    log_path = Path(args.log) if args.log else out.with_suffix(".log")
    url = f"http://127.0.0.1:{args.port}"
    before = worker_processes()
    cmd = [sys.executable, "-m", "kestrel.cli", "serve", args.model, "--port", str(args.port), "--device",
           args.device, "--tensor-parallel-size", str(args.tensor_parallel_size), "--disable-log-requests",
           "--disable-log-stats", *extra]
    result: dict = {"command": " ".join(cmd), "tensor_parallel_size": args.tensor_parallel_size, "ok": False}
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    tree: dict[int, tuple[str, str]] = {}
    try:
        ready, why = wait_ready(url, proc, args.ready_timeout)
        result.update(ready=ready, ready_s=round(time.monotonic() - t0, 2), ready_detail=why)
        if not ready:
            result["error"] = why
            return finish(result, out)
        tree = descendants(proc.pid, process_table())
        result["processes"] = len(tree)
        result["workers_seen"] = sum(WORKER in cmd for _, cmd in tree.values())
        status, body = http(f"{url}/v1/completions", {"prompt": "t5 t6 t7", "max_tokens": 4}, timeout=60)
        result["short_request"] = status
        _, models = http(f"{url}/v1/models")
        max_len = min([m.get("max_model_len") or 4096 for m in models.get("data", [])] or [4096])
        # A long request decoding when SIGTERM comes: shutdown must abort it and stop the ranks mid-generation.
        long_status: list = []
        long_request = {"prompt": "t5 t6 t7", "max_tokens": max(1, min(4000, max_len - 16)), "ignore_eos": True}
        threading.Thread(target=lambda: long_status.append(_quiet_post(f"{url}/v1/completions", long_request)),
                         daemon=True).start()
        time.sleep(1.0)
        tree |= descendants(proc.pid, process_table())
        proc.send_signal(signal.SIGTERM)
        t_term = time.monotonic()
        try:
            proc.wait(args.exit_timeout)
            result.update(exited=True, exit_s=round(time.monotonic() - t_term, 2), returncode=proc.returncode)
        except subprocess.TimeoutExpired:
            result.update(exited=False, exit_s=None, returncode=None,
                          error=f"still running {args.exit_timeout:g} s after SIGTERM")
        result["in_flight_request"] = long_status[0] if long_status else "no answer yet"
        deadline = time.monotonic() + args.reap_timeout
        while still_alive(tree) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = still_alive(tree)
        strays = {pid: cmd for pid, (_, cmd) in worker_processes().items() if pid not in before}
        result["left_behind"] = [f"{pid} {cmd[:160]}" for pid, cmd in {**left, **strays}.items()]
        result["ok"] = bool(result["exited"] and result["returncode"] == 0 and not result["left_behind"]
                            and result["workers_seen"] == args.tensor_parallel_size - 1)
        return finish(result, out)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in still_alive(tree):   # this check's own server's processes: gone before anything runs next
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def _quiet_post(url: str, body: dict) -> int | str:
    try:
        return http(url, body, timeout=120)[0]
    except Exception as exc:   # noqa: BLE001 - the server going away mid-request is the expected outcome
        return type(exc).__name__


def finish(result: dict, out: Path) -> int:
    out.write_text(json.dumps(result, indent=1))
    verdict = "ok" if result["ok"] else "FAILED"
    print(f"SIGTERM at TP={result['tensor_parallel_size']}: {verdict}; ready {result.get('ready_s')} s, "
          f"exit {result.get('exit_s')} s (code {result.get('returncode')}), {result.get('workers_seen')} worker(s) "
          f"seen, left behind: {result.get('left_behind') or 'none'}"
          f"{'; ' + result['error'] if result.get('error') else ''}", flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
