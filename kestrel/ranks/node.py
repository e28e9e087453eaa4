"""`kestrel serve --node-rank N` (N > 0): this node's ranks, no HTTP (node 0's server answers for all of them).

It starts this node's workers, which meet rank 0 at --dist-init-addr, and waits. A worker that fails is written
to rank 0's store (`failed`), where rank 0's watch reads it: the server stops with that message. When rank 0
stops the ranks, the workers exit cleanly and so does this command.
"""
from __future__ import annotations

import logging
import signal
import threading

from kestrel.config import EngineConfig
from kestrel.ranks.group import FAILED_KEY, open_store, rendezvous_of
from kestrel.ranks.workers import RankWatch, start_workers, stop_workers

logger = logging.getLogger("kestrel.distributed")


def serve_node(config: EngineConfig) -> int:
    rdv = rendezvous_of(config)
    store = open_store(rdv, is_master=False)   # waits (up to --dist-timeout) for rank 0's store
    ranks = rdv.ranks_of_node(config.node_rank)
    logger.info("node %d of %d: ranks %d..%d, meeting rank 0 at %s:%d", config.node_rank, config.nnodes,
                ranks[0], ranks[-1], rdv.host, rdv.port)
    procs = start_workers(config, rdv, ranks)
    done = threading.Event()
    failure: list[str] = []

    def on_failure(message: str) -> None:
        failure.append(message)
        try:
            store.set(FAILED_KEY, f"node {config.node_rank}: {message}")
        except Exception:   # noqa: BLE001 - rank 0 is gone too: nobody is left to tell
            pass
        done.set()

    watch = RankWatch(procs, on_failure, clean_exit_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    try:
        while not done.wait(0.5):
            if all(p.poll() == 0 for p in procs.values()):   # rank 0 said stop
                logger.info("node %d: the ranks stopped", config.node_rank)
                break
    except KeyboardInterrupt:
        pass
    finally:
        watch.stop()
        stop_workers(procs)
    # The ranks are gone and this process is exiting. Python resets its handlers to the default while it
    # finalizes, so a SIGTERM then (node 0's supervisor stopping this node too) would turn a clean exit into
    # death by signal; ignored, the exit status stays this function's.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if failure:
        print(f"error: {failure[0]}", flush=True)
        return 1
    return 0
