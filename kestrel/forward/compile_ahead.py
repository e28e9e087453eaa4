"""Compile ahead: the model's kernels compiled by child processes while the engine resolves and loads the model.

On a fresh machine (no kernel caches) the Llama-3.1-8B shape's startup compiles 20 Triton and NVRTC kernels
one after another, ~12 s on an H100, and threads cannot share that work: a Triton compile holds the GIL nearly
throughout. So when startup begins on CUDA, a few child processes build the same model with its first two layers
only, weights left as allocated (their values do not change which kernels compile), and run the steps that compile
(the activation profile, the prefill graphs, a share of the decode graphs' batch-size buckets, the warm-up). Their
compiles land in the on-disk caches (Triton's, and kestrel/kernels/cuda/cuda_rtc.py's), where the engine's own
compile of the same kernel finds them:

    engine:    resolve ── build ── load weights ─────────── [wait] profile ── graphs ── warm up   (cache hits)
    worker 0:  import ── build 2 layers ── profile, prefill graphs, warm-up                          (compiles)
    worker 1:  import ── build 2 layers ── decode graphs of buckets 1, 16 .. max_bs
    worker 2:  import ── build 2 layers ── decode graphs of buckets 2, 8
    worker 3:  import ── build 2 layers ── decode graphs of bucket 4

The same code builds and runs the model in both, so each launch specialises its kernels the same way (the same
widths, strides and block-table shapes; only the layer count differs, which no kernel sees). The engine waits for
the workers before it sizes the KV cache: their GPU memory must be free by then. A worker that fails costs nothing
but its own time: the engine compiles what it did not.
"""
from __future__ import annotations

import logging
import pickle
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kestrel.config import EngineConfig
from kestrel.distributed.comm import SINGLE, TPGroup
from kestrel.models.model_config import ModelConfig
from kestrel.progress import Progress

logger = logging.getLogger("kestrel.compile_ahead")

WORKER_LAYERS = 2
WAIT_S = 60.0          # the longest the engine waits for its workers before it stops them
SMALL_BUCKETS = 4      # decode buckets 1, 2, 4, 8 each compile their own attention variant: spread them out


@dataclass(frozen=True)
class Job:
    config: EngineConfig
    device: str
    max_model_len: int
    prefill: bool = False                              # the activation profile, prefill graphs and warm-up
    buckets: list[int] = field(default_factory=list)   # decode-graph batch sizes


@dataclass
class Worker:
    job: Job
    process: subprocess.Popen
    log: Path
    started: float


class CompileAhead:
    def __init__(self, workers: list[Worker]) -> None:
        self.workers = workers

    def finish(self, progress: Progress | None = None, wait_s: float = WAIT_S) -> None:
        """Wait for every worker (stopping any still running after wait_s) and log how each did; a wait shows as
        the phase "compiling kernels", counting the workers done."""
        deadline = time.monotonic() + wait_s
        running = [w for w in self.workers if w.process.poll() is None]
        if running and progress is not None:
            progress.begin("compiling_kernels", len(self.workers), "workers")
        for i, w in enumerate(self.workers):
            try:
                w.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                w.process.kill()
                w.process.wait()
            seconds = time.monotonic() - w.started
            what = ("prefill" if w.job.prefill else "") + (f" buckets {w.job.buckets}" if w.job.buckets else "")
            if running and progress is not None:
                progress.update(i + 1)
            if w.process.returncode == 0:
                logger.info("compile worker (%s) done in %.1f s", what.strip(), seconds)
                w.log.unlink(missing_ok=True)
            else:
                logger.info("compile worker (%s) exited %s after %.1f s; the engine compiles its kernels itself "
                            "(log: %s)", what.strip(), w.process.returncode, seconds, w.log)


def plan_jobs(config: EngineConfig, device: torch.device, max_model_len: int, workers: int) -> list[Job]:
    """One prefill job and the decode buckets spread over the other workers (all in one job with one worker)."""
    from kestrel.forward.decode_graphs import batch_size_buckets

    buckets = batch_size_buckets(min(config.cuda_graph_max_bs, config.max_num_seqs))
    base = dict(config=config, device=str(device), max_model_len=max_model_len)
    if workers == 1:
        return [Job(prefill=True, buckets=buckets, **base)]
    shares: list[list[int]] = [[] for _ in range(workers - 1)]
    small, large = buckets[:SMALL_BUCKETS], buckets[SMALL_BUCKETS:]
    for i, bs in enumerate(small):
        shares[i % len(shares)].append(bs)
    shares[0] += large
    return [Job(prefill=True, **base)] + [Job(buckets=share, **base) for share in shares if share]


def worker_bytes(cfg: ModelConfig, checkpoint_bytes: int, dtype_bytes: int) -> int:
    """A worker's device memory, roughly: embeddings and head, two layers, a CUDA context and activations."""
    embeddings = cfg.vocab_size * cfg.hidden_size * dtype_bytes * (1 if cfg.tie_word_embeddings else 2)
    per_layer = max(0, checkpoint_bytes - embeddings) // max(1, cfg.num_layers)
    return embeddings + WORKER_LAYERS * per_layer + (2 << 30)


def model_bytes(config: EngineConfig, cfg: ModelConfig, dtype_bytes: int) -> int:
    """The weights the engine will hold: the checkpoint's size, or with dummy weights the parameters of the model
    built on the meta device (no memory)."""
    path = config.model_path
    if config.load_format != "dummy":
        return path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.glob("*.safetensors"))
    from kestrel.layers.ops import TORCH_OPS
    from kestrel.models.registry import model_class
    with torch.device("meta"):
        model = model_class(cfg)(cfg, TORCH_OPS, SINGLE)
    return sum(p.numel() for p in model.parameters()) * dtype_bytes


def start_compile_ahead(config: EngineConfig, cfg: ModelConfig, device: torch.device, tp: TPGroup,
                        max_model_len: int) -> CompileAhead | None:
    """Start the workers, when they can help and fit: CUDA with graphs, one rank, and device memory for the model
    and every worker at once (fewer workers where only some fit)."""
    if device.type != "cuda" or config.compile_workers == 0 or config.disable_cuda_graph or tp.size > 1 \
            or cfg.kv_lora_rank:   # MLA captures decode graphs only (startup.py); the workers plan both
        return None
    free, _ = torch.cuda.mem_get_info(device)
    weights = model_bytes(config, cfg, 2)
    each = worker_bytes(cfg, weights, 2)
    workers = min(config.compile_workers, int((0.8 * free - weights) // each))
    if workers < 1:
        logger.info("compile workers: none (%.1f GiB free on the device, %.1f GiB of weights)", free / 2**30,
                    weights / 2**30)
        return None
    jobs = plan_jobs(config, device, max_model_len, workers)
    folder = Path(tempfile.mkdtemp(prefix="kestrel-compile-"))
    started = []
    for i, job in enumerate(jobs):
        spec, log = folder / f"job{i}.pkl", folder / f"worker{i}.log"
        spec.write_bytes(pickle.dumps(job))
        with open(log, "wb") as out:
            process = subprocess.Popen([sys.executable, "-m", "kestrel.forward.compile_worker", str(spec)],
                                       stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        started.append(Worker(job, process, log, time.monotonic()))
    logger.info("compiling kernels ahead in %d worker processes while the model loads", len(started))
    return CompileAhead(started)
