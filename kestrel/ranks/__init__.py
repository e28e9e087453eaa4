"""Tensor parallelism's processes: one per rank, rank 0 schedules and the others follow (docs/architecture.md).
The collectives the sharded layers call live below, in distributed/.

    group.py    the rendezvous: rank 0's TCP store, joining the process groups, the ranks' layout over nodes
    workers.py  starting this node's worker processes and watching them (a rank that dies or hangs is reported)
    driver.py   rank 0: start the ranks, then DriverRunner tells them each step before running it
    worker.py   ranks > 0: build the same runner (their shard), then run each step rank 0 sends
    node.py     `--node-rank N > 0`: a node that only hosts worker ranks
"""
