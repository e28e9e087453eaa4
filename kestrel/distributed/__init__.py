"""Tensor parallelism: one process per rank, rank 0 schedules and the others follow (docs/architecture.md).

    comm.py     TPGroup: a rank's groups (device, CPU) and the collectives the sharded layers call
    group.py    the rendezvous: rank 0's TCP store, joining the process groups, the ranks' layout over nodes
    workers.py  starting this node's worker processes and watching them (a rank that dies or hangs is reported)
    driver.py   rank 0: start the ranks, then DriverRunner tells them each step before running it
    worker.py   ranks > 0: build the same runner (their shard), then run each step rank 0 sends
"""
