"""SymmMemAllReduce: the row-parallel all-reduce of small messages over torch's symmetric memory, beside NCCL.

Decode on the 8B shape all-reduces 8 KB per layer twice (65 a step at bs1); NCCL's latency for such a message is
~10-20 us, most of a TP decode step. Symmetric memory maps every rank's copy of one buffer into every rank's
address space (CUDA IPC over NVLink), so a reduce is one kernel that reads the peers' copies directly:

    rank r:  x --copy--> buf_r            (buf_0 .. buf_{n-1}: one allocation per rank, all mapped everywhere)
             one-shot:  out = buf_0 + buf_1 + ... + buf_{n-1}           every rank reads every peer's whole buffer
             two-shot:  rank r sums slice r over the peers, then gathers the other slices (half the reads at n=2,
                        better past ~256 KB)

Both ops signal through the buffer's signal pad inside the kernel, so they need no host barrier and can be
captured in a CUDA graph. Only the P2P ops are used, never the NVLink multicast (`multimem_*`) ones: multicast
is off on these machines (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1).

Messages past `max_bytes`, other dtypes, or a rendezvous that fails (no P2P between the GPUs, an old torch) go to
NCCL; the choice is made per call from the message size, the same on every rank, so the ranks never disagree on
which collective they are in.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

logger = logging.getLogger("kestrel.distributed")

# Below this, one-shot (each rank reads all peers) beats two-shot (reduce-scatter + all-gather through the peers);
# the crossover vLLM and SGLang measured on H100 NVLink for 2-8 ranks is 128-512 KB.
ONE_SHOT_MAX_BYTES = 256 * 1024
# The symmetric buffer: decode at 128 concurrent on a 4096-wide model is 1 MiB a reduce; prefill chunks are larger
# and bandwidth-bound, where NCCL is as fast.
DEFAULT_MAX_BYTES = 2 * 1024 * 1024
SUPPORTED_WORLD_SIZES = (2, 4, 6, 8)


@dataclass(frozen=True, slots=True)
class Route:
    """Which collective a message takes: 'one_shot', 'two_shot' or 'nccl'."""
    kind: str
    reason: str = ""


REDUCIBLE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def route_for(numel: int, dtype: torch.dtype, world_size: int, max_bytes: int,
              one_shot_max: int = ONE_SHOT_MAX_BYTES) -> Route:
    """The collective for one message: a pure function of its shape and dtype, so every rank picks the same."""
    nbytes = numel * dtype.itemsize
    if dtype not in REDUCIBLE_DTYPES:
        return Route("nccl", f"dtype {dtype} is not one the kernels reduce")
    if nbytes > max_bytes:
        return Route("nccl", f"{nbytes} bytes exceed the symmetric buffer's {max_bytes}")
    if nbytes % 16:
        return Route("nccl", "not a multiple of 16 bytes (the kernels' vector width)")
    if nbytes <= one_shot_max:
        return Route("one_shot")
    if numel % world_size:
        return Route("nccl", f"{numel} elements do not split over {world_size} ranks (two-shot's slices)")
    return Route("two_shot")


class SymmMemAllReduce:
    """One rank's symmetric buffer and the ops over it; `open` returns None where it cannot work."""

    def __init__(self, buffer: torch.Tensor, group_name: str, world_size: int) -> None:
        self.buffer = buffer            # uint8: viewed as each message's dtype (the same storage, still symmetric)
        self.group_name = group_name
        self.world_size = world_size
        self.max_bytes = buffer.numel()

    @classmethod
    def open(cls, group: dist.ProcessGroup, world_size: int, device: torch.device,
             max_bytes: int = DEFAULT_MAX_BYTES) -> SymmMemAllReduce | None:
        """Allocate and rendezvous the buffer (a collective: every rank calls it); None, with the reason logged,
        on a CPU group, an unsupported world size, or a torch / GPU link without symmetric memory."""
        if device.type != "cuda":
            return None
        if world_size not in SUPPORTED_WORLD_SIZES:
            logger.info("custom all-reduce off: %d ranks (supported: %s); NCCL for every message",
                        world_size, SUPPORTED_WORLD_SIZES)
            return None
        probe, why = None, ""
        try:
            import torch.distributed._symmetric_memory as symm_mem
            group_name = group.group_name
            if hasattr(symm_mem, "enable_symm_mem_for_group"):   # needed before torch 2.8, a no-op after
                symm_mem.enable_symm_mem_for_group(group_name)
            buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
            symm_mem.rendezvous(buffer, group_name)
            probe = cls(buffer, group_name, world_size)
            probe._check(group, device)
        except Exception as exc:   # noqa: BLE001 - any failure leaves NCCL in charge, said once in the log
            probe, why = None, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        # every rank takes the same road or none does: one rank on NCCL and another on symmetric memory would wait
        # on each other forever
        everywhere = torch.tensor([int(probe is not None)], device=device)
        dist.all_reduce(everywhere, op=dist.ReduceOp.MIN, group=group)
        if not everywhere.item():
            logger.warning("custom all-reduce off (%s); NCCL for every message", why or "another rank failed")
            return None
        logger.info("custom all-reduce on: symmetric memory, one-shot up to %d KB, two-shot up to %d KB",
                    ONE_SHOT_MAX_BYTES // 1024, max_bytes // 1024)
        return probe

    def _check(self, group: dist.ProcessGroup, device: torch.device) -> None:
        """Both roads against NCCL on one message each, before either is trusted (raises on a mismatch); small
        integers, so every summation order gives the same bits."""
        rank = dist.get_rank(group)
        for numel in (4096, ONE_SHOT_MAX_BYTES):   # bf16: 8 KB (one-shot) and 512 KB (two-shot)
            x = (torch.arange(numel, device=device) % 7 + rank).to(torch.bfloat16)
            want = x.clone()
            dist.all_reduce(want, group=group)
            got = self.all_reduce(x.clone())
            if got is None or not torch.equal(got, want):
                raise RuntimeError(f"symmetric-memory all-reduce disagrees with NCCL at {numel} elements")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor | None:
        """Sum of x over the ranks into x, or None (x untouched) when the message is NCCL's to carry."""
        route = route_for(x.numel(), x.dtype, self.world_size, self.max_bytes)
        if route.kind == "nccl" or not x.is_contiguous():
            return None
        staged = self.buffer.view(x.dtype)[: x.numel()]
        staged.copy_(x.view(-1))
        if route.kind == "one_shot":
            torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", self.group_name, x.view(-1))
        else:
            torch.ops.symm_mem.two_shot_all_reduce_(staged, "sum", self.group_name)
            x.view(-1).copy_(staged)
        return x
