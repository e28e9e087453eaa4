"""A rank > 0: `python -m kestrel.ranks.worker`, its WorkerSpec on stdin (ranks/workers.py).

It joins the groups, builds the same runner as rank 0 through the same startup (forward/startup.py: its shard of
the weights, the KV cache of its KV heads, the same graphs in the same order, the same warm-up), then runs each
step rank 0 sends, in rank 0's order:

    ("execute", chunks)          runner.execute(chunks)  (a graph replay or eager; the outputs stay here)
    ("forward", batch, float)    runner.forward(batch)   (prompt logits)
    ("tokens",)                  the sampled tokens of the last launch, from rank 0 (the overlap schedule)
    ("move_kv", src, dst)        runner.move_kv(src, dst)  (a tree verify step's accepted path, next to its root)
    ("stop",)                    leave
"""
from __future__ import annotations

import logging
import os
import pickle
import sys
import threading

from kestrel.distributed.comm import TPGroup
from kestrel.ranks.workers import WorkerSpec

logger = logging.getLogger("kestrel.distributed")


def follow(runner, tp: TPGroup) -> None:
    """Run rank 0's steps until it says stop."""
    last = None
    while True:
        command = tp.broadcast_object()
        op = command[0]
        if op == "execute":
            last = runner.execute(command[1])
        elif op == "forward":
            runner.forward(command[1], command[2])
        elif op == "tokens":
            tp.broadcast_tensor(last.tokens)
        elif op == "move_kv":
            runner.move_kv(command[1], command[2])
        elif op == "stop":
            return
        else:
            raise AssertionError(f"unknown step command {op!r}")


def _exit_at_eof() -> None:
    """stdin is the starter's pipe: EOF means it is gone (or stopping us)."""
    sys.stdin.buffer.read()
    os._exit(0)


def main() -> None:
    spec: WorkerSpec = pickle.load(sys.stdin.buffer)
    threading.Thread(target=_exit_at_eof, name="kestrel-parent-watch", daemon=True).start()
    logging.basicConfig(level=spec.log_level, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s %(name)s[rank {spec.rank}]: %(message)s")
    from kestrel.ranks.group import join_group, open_store
    from kestrel.forward.startup import build_runner, resolve_device
    from kestrel.envs import omp_threads_set
    from kestrel.progress import Progress

    device_type = resolve_device(spec.config.device).type
    if device_type == "cpu" and not omp_threads_set():
        # CPU ranks share the node's cores: intra-op threads on every core in every rank spin against each other
        import torch
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // spec.rendezvous.ranks_per_node))
    try:
        store = open_store(spec.rendezvous, is_master=False)
        tp = join_group(spec.rendezvous, spec.rank, store, device_type,
                        custom_all_reduce=not spec.config.disable_custom_all_reduce)
        setup = build_runner(spec.config, Progress(), tp)   # Progress: the phases in this rank's log
    except Exception:   # noqa: BLE001 - said here, in this rank's log; rank 0's watch names the exit
        logger.exception("rank %d failed to start", spec.rank)
        _exit(1)
    logger.info("rank %d ready: following rank 0", spec.rank)
    try:
        follow(setup.runner, tp)
    except RuntimeError as exc:   # a collective failed: rank 0 (or another rank) is gone
        logger.error("rank %d: the other ranks are gone (%s); exiting", spec.rank, str(exc).splitlines()[0])
        _exit(1)
    logger.info("rank %d: stopped by rank 0", spec.rank)
    _exit(0)


def _exit(code: int) -> None:
    """Exit now: the stdin thread (blocked in a read) would make the interpreter's shutdown abort."""
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
