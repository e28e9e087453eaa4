"""A compile worker (forward/compile_ahead.py): `python -m kestrel.forward.compile_worker JOB.pkl` builds the model's
first layers with the engine's own startup code and runs the job's steps, which compile its kernels into the on-disk
caches (on the CPU, which compiles nothing, the same steps run eagerly: the tests)."""
from __future__ import annotations

import dataclasses
import logging
import pickle
import sys
from pathlib import Path

import torch

from kestrel.forward.compile_ahead import WORKER_LAYERS, Job
from kestrel.forward.startup import build_model, profile_activation_peak, resolve_dtype, resolve_kv_dtype
from kestrel.forward.warm_up import warm_up
from kestrel.forward.decode_graphs import DecodeGraphs
from kestrel.forward.prefill_graphs import PrefillGraphs
from kestrel.forward.runner import ModelRunner
from kestrel.models.checkpoint import load_model_config


@torch.inference_mode()
def run_job(job: Job) -> None:
    """Build the model's first layers and run the job's steps (on CUDA they compile its kernels)."""
    config, device = job.config, torch.device(job.device)
    if device.type == "cuda" and device.index is not None:   # "cuda" alone is the current device already
        torch.cuda.set_device(device)
    full = load_model_config(config.model_path)
    cfg = dataclasses.replace(full, num_layers=min(full.num_layers, WORKER_LAYERS))
    dtype = resolve_dtype(config.dtype, cfg, device)
    model, backend, _ = build_model(config, cfg, device, dtype)
    model.eval()
    runner = ModelRunner(model, cfg, backend, device, dtype, config.block_size,
                         kv_dtype=resolve_kv_dtype(config.kv_cache_dtype, dtype))
    max_blocks = -(-job.max_model_len // config.block_size)
    cuda = device.type == "cuda"
    if job.prefill:
        if cuda:
            profile_activation_peak(runner, config, job.max_model_len)
        runner.allocate_kv_cache(2)
        if not config.disable_prefill_cuda_graph:
            PrefillGraphs(runner, max_blocks, config.max_num_batched_tokens).capture(dry_run=not cuda)
        warm_up(runner, config.block_size, config.max_num_batched_tokens, job.max_model_len)
        runner.free_kv_cache()
    if job.buckets:
        runner.allocate_kv_cache(2)
        graphs = DecodeGraphs(runner, min(config.cuda_graph_max_bs, config.max_num_seqs), max_blocks,
                              config.max_num_seqs)
        graphs.buckets = list(job.buckets)
        if cuda:
            graphs.capture()
        else:   # the CPU tests: the same bodies, eagerly
            for bs in graphs.buckets:
                graphs._graph_body(bs)


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.WARNING)
    job = pickle.loads(Path(argv[0]).read_bytes())
    run_job(job)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
