"""The collectives the sharded layers call (imports nothing of kestrel; the rank processes are ranks/).

    comm.py               TPGroup: a rank's groups (device, CPU) and the all-reduce / all-gather the layers call
    custom_all_reduce.py  the symmetric-memory all-reduce for small messages on one node
"""
