"""Compile ahead (kestrel/forward/compile_ahead.py): the plan spreads the decode buckets over the workers, startup
starts none off CUDA, and a worker process builds the model's first layers and runs its job's steps (on CPU the
steps run eagerly; on CUDA the same steps compile the kernels into the disk caches)."""
from __future__ import annotations

import pytest

import pickle
import subprocess
import sys

import torch

from kestrel.config import EngineConfig
from kestrel.distributed.comm import SINGLE
from kestrel.forward.compile_ahead import Job, plan_jobs, start_compile_ahead
from kestrel.forward.decode_graphs import batch_size_buckets
from kestrel.models.checkpoint import load_model_config


def test_the_plan_covers_every_bucket_once_and_spreads_the_small_ones():
    config = EngineConfig(cuda_graph_max_bs=64)
    jobs = plan_jobs(config, torch.device("cuda"), 4096, workers=4)
    assert [j.prefill for j in jobs] == [True, False, False, False]
    buckets = [bs for j in jobs for bs in j.buckets]
    assert sorted(buckets) == batch_size_buckets(64)
    assert [sorted(j.buckets)[0] for j in jobs[1:]] == [1, 2, 4]          # 1, 2, 4, 8 on different workers first
    one = plan_jobs(config, torch.device("cuda"), 4096, workers=1)
    assert len(one) == 1 and one[0].prefill and one[0].buckets == batch_size_buckets(64)


def test_no_workers_off_cuda_or_when_turned_off(checkpoint_factory):
    path = checkpoint_factory("llama")
    cfg = load_model_config(path)
    assert start_compile_ahead(EngineConfig(model=str(path)), cfg, torch.device("cpu"), SINGLE, 256) is None
    off = EngineConfig(model=str(path), compile_workers=0)
    assert start_compile_ahead(off, cfg, torch.device("cuda"), SINGLE, 256) is None


@pytest.mark.slow
def test_a_worker_process_runs_both_kinds_of_job(checkpoint_factory, tmp_path):
    config = EngineConfig(model=str(checkpoint_factory("qwen3")), device="cpu", block_size=4,
                          max_num_batched_tokens=64, cuda_graph_max_bs=4, max_num_seqs=4)
    for i, job in enumerate([Job(config, "cpu", 128, prefill=True), Job(config, "cpu", 128, buckets=[1, 4])]):
        spec = tmp_path / f"job{i}.pkl"
        spec.write_bytes(pickle.dumps(job))
        done = subprocess.run([sys.executable, "-m", "kestrel.forward.compile_worker", str(spec)],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]


def test_dummy_weights_are_counted_from_the_model_built_on_meta(checkpoint_factory):
    from kestrel.forward.compile_ahead import model_bytes
    path = checkpoint_factory("llama")
    cfg = load_model_config(path)
    on_disk = model_bytes(EngineConfig(model=str(path)), cfg, 4)          # the fixture is float32 safetensors
    dummy = model_bytes(EngineConfig(model=str(path), load_format="dummy"), cfg, 4)
    assert abs(dummy - on_disk) / on_disk < 0.05, (dummy, on_disk)
