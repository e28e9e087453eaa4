"""Rank 0: start the other ranks, and a runner that tells them every step before running it.

    Engine (rank 0 only: scheduler, sampler, stop rules)
      └► DriverRunner.execute(chunks) ── broadcast ("execute", chunks) over the CPU group ──► every worker
           └► ModelRunner.execute(chunks)                                                     ModelRunner.execute
                 the model's all-reduces / all-gather meet across the ranks (device group)

Every rank holds the same runner state (graphs, their block-table rows), so each takes the same road and
replays the same graph; the logits are gathered on every rank, rank 0 samples. Speculative decoding adds nothing
to this: rank 0 drafts (an EAGLE-3 drafter lives on rank 0 only) and verifies, the drafts reach the other ranks
inside the verify step's chunks, and a tree step's accepted K/V moves on every rank ("move_kv"). Startup needs no commands: every
rank runs the same startup, whose forwards meet in the same order.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from kestrel.config import EngineConfig
from kestrel.distributed.comm import TPGroup
from kestrel.ranks.group import join_group, leave_group, open_store, rendezvous_of
from kestrel.ranks.workers import RankWatch, start_workers, stop_workers
from kestrel.errors import KestrelError
from kestrel.batch import ForwardBatch, ForwardOutput, SequenceChunk
from kestrel.forward.runner import ModelRunner
from kestrel.layers.linear import check_tp_shape
from kestrel.layers.moe import check_moe_tp_shape
from kestrel.models.checkpoint import load_model_config
from kestrel.models.model_config import ModelConfig
from kestrel.progress import Progress

logger = logging.getLogger("kestrel.distributed")

OnFailure = Callable[[str], None]


class RankFailure(KestrelError):
    """A tensor-parallel rank died or hangs: the ranks cannot go on together."""


class Ranks:
    """Rank 0's handle on the others: its group, this node's worker processes, the store, the watch."""

    def __init__(self, config: EngineConfig, progress: Progress, on_failure: OnFailure | None = None) -> None:
        n = config.tensor_parallel_size
        cfg = load_model_config(config.model_path)
        why = why_unsplittable(cfg, n)   # before any worker starts (the model refuses it too)
        if why is not None:
            raise KestrelError(f"--tensor-parallel-size {n}: the model cannot be split, {why}")
        rdv = rendezvous_of(config)
        progress.begin("starting_ranks", n, "ranks")
        self.store = open_store(rdv, is_master=True)
        self.procs = start_workers(config, rdv, rdv.ranks_of_node(0)[1:])
        self.busy_since: float | None = None
        self.watch = RankWatch(self.procs, on_failure or (lambda message: None), self.store,
                               lambda: self.busy_since, config.dist_timeout)
        try:
            self.tp = join_group(rdv, 0, self.store, _device_type(config),
                                 custom_all_reduce=not config.disable_custom_all_reduce)
        except KestrelError:
            self.close()
            if self.watch.failure is not None:
                raise RankFailure(self.watch.failure) from None
            raise
        progress.update(n)
        logger.info("%d tensor-parallel ranks joined at %s:%d (%d node(s))", n, rdv.host, rdv.port, config.nnodes)

    def explain(self, exc: BaseException, wait_s: float = 2.0) -> BaseException:
        """A collective that failed (RuntimeError) because a rank died: RankFailure naming the rank, once the
        watch has found it (within wait_s); any other error as it is."""
        if not isinstance(exc, RuntimeError):
            return exc
        deadline = time.monotonic() + wait_s
        while self.watch.failure is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return RankFailure(self.watch.failure or f"a tensor-parallel collective failed: {exc}")

    def close(self) -> None:
        self.watch.stop()
        stop_workers(self.procs)
        leave_group()


def why_unsplittable(cfg: ModelConfig, n: int) -> str | None:
    """Why the model cannot be split over n ranks (None: it can): heads, MLP width, experts' width."""
    # MLA caches one latent head shared by all (replicated on every rank): only its query heads are split
    kv_heads = cfg.num_heads if cfg.kv_lora_rank else cfg.num_kv_heads
    # a MoE model without dense layers never builds a dense MLP: its intermediate_size is not split (0 divides)
    dense_width = cfg.intermediate_size if not cfg.num_experts or cfg.dense_layers else 0
    why = check_tp_shape(cfg.num_heads, kv_heads, dense_width, n)
    if why is None and cfg.num_experts:
        why = check_moe_tp_shape(cfg.moe_intermediate_size, n)
    return why


def _device_type(config: EngineConfig) -> str:
    from kestrel.forward.startup import resolve_device

    return resolve_device(config.device).type


class DriverRunner:
    """Rank 0's runner: each step goes to the other ranks, then runs here. Everything else (graphs, device, the
    KV cache) is the local ModelRunner's, read through."""

    def __init__(self, runner: ModelRunner, ranks: Ranks) -> None:
        self.runner = runner
        self.ranks = ranks
        self.tp: TPGroup = ranks.tp

    def __getattr__(self, name: str):
        # only reached for what this class does not define: the local runner's attributes (graphs, device, ...)
        runner = self.__dict__.get("runner")
        if runner is None:   # released (llm.py clears a runner's attributes)
            raise AttributeError(name)
        return getattr(runner, name)

    def execute(self, chunks: list[SequenceChunk]) -> ForwardOutput:
        return self._step(("execute", chunks), lambda: self.runner.execute(chunks))

    def forward(self, batch: ForwardBatch, float_logits: bool = True) -> ForwardOutput:
        host_batch = batch if batch.input_ids.device.type == "cpu" else batch.to(torch.device("cpu"))
        return self._step(("forward", host_batch, float_logits), lambda: self.runner.forward(batch, float_logits))

    def share_sampled_tokens(self, tokens: torch.Tensor) -> None:
        self._step(("tokens",), lambda: self.tp.broadcast_tensor(tokens))

    def move_kv(self, src: list[int], dst: list[int]) -> None:
        self._step(("move_kv", src, dst), lambda: self.runner.move_kv(src, dst))

    def _step(self, command: tuple, run: Callable[[], object]):
        self.ranks.busy_since = time.monotonic()
        try:
            self.tp.broadcast_object(command)
            return run()
        except RuntimeError as exc:   # a collective failed: a rank is gone; the watch says which, soon
            raise self.ranks.explain(exc) from exc
        finally:
            self.ranks.busy_since = None

    def close(self) -> None:
        """Tell the workers to stop, then stop them (idempotent)."""
        ranks, self.__dict__["ranks"] = self.__dict__.get("ranks"), None
        if ranks is None:
            return
        if ranks.watch.failure is None:
            try:
                self.tp.broadcast_object(("stop",))
            except RuntimeError:
                pass
        ranks.close()
        self.runner.close()
