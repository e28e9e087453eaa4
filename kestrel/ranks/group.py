"""The rendezvous: every rank meets at rank 0's TCP store and joins two process groups over the same ranks.

Ranks are laid out node by node, as SGLang's launcher does:

    node n of `nnodes` runs ranks [n * per_node, (n + 1) * per_node), per_node = tensor_parallel_size / nnodes
    a rank's GPU is cuda:(rank - n * per_node)

The store also carries what the processes tell each other outside the collectives: a node whose rank died
writes `failed` (rank 0's watch reads it, ranks/workers.py).
"""
from __future__ import annotations

import logging
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from kestrel.config import EngineConfig
from kestrel.distributed.comm import TPGroup
from kestrel.distributed.custom_all_reduce import SymmMemAllReduce
from kestrel.envs import disable_nccl_nvls
from kestrel.errors import KestrelError

logger = logging.getLogger("kestrel.distributed")

FAILED_KEY = "kestrel/failed"


@dataclass(frozen=True, slots=True)
class Rendezvous:
    host: str
    port: int
    world_size: int
    ranks_per_node: int
    timeout_s: float

    def ranks_of_node(self, node_rank: int) -> range:
        return range(node_rank * self.ranks_per_node, (node_rank + 1) * self.ranks_per_node)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def rendezvous_of(config: EngineConfig) -> Rendezvous:
    """Where the ranks of this config meet; one node without --dist-init-addr: a free port on loopback."""
    host, port = config.dist_address or ("127.0.0.1", free_port())
    return Rendezvous(host, port, config.tensor_parallel_size, config.tensor_parallel_size // config.nnodes,
                      config.dist_timeout)


def open_store(rdv: Rendezvous, is_master: bool) -> dist.TCPStore:
    """Rank 0 hosts the store (is_master); every other process connects to it."""
    try:
        return dist.TCPStore(rdv.host, rdv.port, rdv.world_size, is_master=is_master,
                             timeout=timedelta(seconds=rdv.timeout_s), wait_for_workers=False)
    except (RuntimeError, OSError) as exc:
        what = "listen on" if is_master else "reach rank 0's rendezvous at"
        raise KestrelError(f"tensor parallelism: cannot {what} {rdv.host}:{rdv.port} ({exc}); check "
                           "--dist-init-addr") from None


def join_group(rdv: Rendezvous, rank: int, store: dist.TCPStore, device_type: str,
               custom_all_reduce: bool = True) -> TPGroup:
    """Join the device group (NCCL on CUDA, gloo on the CPU) and a gloo CPU group beside it; returns when every
    rank has joined, or raises after the rendezvous timeout. On CUDA, custom_all_reduce opens the symmetric-memory
    all-reduce for small messages (every rank must pass the same value: it is a collective)."""
    backend = "nccl" if device_type == "cuda" else "gloo"
    local_rank = rank % rdv.ranks_per_node
    if backend == "nccl":
        disable_nccl_nvls()
        torch.cuda.set_device(local_rank)
    timeout = timedelta(seconds=rdv.timeout_s)
    try:
        dist.init_process_group(backend, store=dist.PrefixStore("pg", store), rank=rank,
                                world_size=rdv.world_size, timeout=timeout)
        cpu_group = dist.new_group(backend="gloo", timeout=timeout)
    except (RuntimeError, dist.DistError) as exc:
        raise KestrelError(f"tensor parallelism: rank {rank} could not join the {rdv.world_size} ranks at "
                           f"{rdv.host}:{rdv.port} within {rdv.timeout_s:g} s ({exc}); is `kestrel serve "
                           "--node-rank N` running on every node?") from None
    logger.info("rank %d of %d joined (%s, local rank %d)", rank, rdv.world_size, backend, local_rank)
    fast = None
    if backend == "nccl" and custom_all_reduce:
        fast = SymmMemAllReduce.open(dist.group.WORLD, rdv.world_size, torch.device("cuda", local_rank))
    return TPGroup(rank, rdv.world_size, dist.group.WORLD, cpu_group, local_rank, fast)


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
