"""Programmatic dependent launch (kestrel/kernels/triton/pdl.py) changes when kernels start, never what they compute: with PDL on,
captured chains of the decode kernels and whole engines give bit-identical results to PDL off. A kernel that
read or wrote before its wait would show here as a difference (a race), not as a tolerance miss."""
from __future__ import annotations

import pytest
import torch

from kestrel.envs import switches
from tests.gpu.engine_tokens import greedy_tokens

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

def test_pdl_is_on_for_hopper_and_off_by_env(monkeypatch):
    from kestrel.kernels.triton.pdl import launch_options
    dev = torch.device("cuda")
    hopper = torch.cuda.get_device_capability()[0] >= 9
    assert launch_options(dev) == ({"launch_pdl": True, "USE_PDL": True} if hopper else {"USE_PDL": False})
    monkeypatch.setenv("KESTREL_PDL", "0")
    switches.cache_clear()   # the switches are read once: read them again
    assert launch_options(dev) == {"USE_PDL": False}


def _layer_chain(x, res, weights):
    """One decoder layer's worth of skinny kernels, each consuming the one before (as in a bs1 step)."""
    from kestrel.kernels.triton import gemv
    norm_w, w_qkv, w_o, w_gu, w_down = weights
    h, res = gemv.add_rms_norm_gemv(x, res, norm_w, 1e-6, w_qkv)
    h = gemv.gemv(h[:, :w_o.shape[1]].contiguous(), w_o)
    h, res = gemv.add_rms_norm_gemv(h, res, norm_w, 1e-6, w_gu)
    return gemv.silu_mul_gemv(h, w_down), res


@pytest.mark.parametrize("rows", [1, 4])
def test_captured_skinny_chain_with_pdl_is_bit_identical(monkeypatch, rows):
    gen = torch.Generator(device="cuda").manual_seed(rows)
    hidden, inter = 1024, 3072
    dt = torch.bfloat16

    def rand(*shape):
        return (torch.randn(*shape, generator=gen, device="cuda") * 0.05).to(dt)

    layers = [(1 + rand(hidden), rand(4096, hidden), rand(hidden, 2048), rand(2 * inter, hidden), rand(hidden, inter))
              for _ in range(6)]
    x, res = rand(rows, hidden), rand(rows, hidden)

    def run_chain():
        h, r = x, res
        for weights in layers:
            h, r = _layer_chain(h, r, weights)
        return h, r

    results = {}
    for pdl in ("0", "1"):
        monkeypatch.setenv("KESTREL_PDL", pdl)
        switches.cache_clear()
        run_chain()   # compile
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run_chain()
        outs = []
        for _ in range(3):
            graph.replay()
            outs.append(tuple(t.clone() for t in out))
        torch.cuda.synchronize()
        results[pdl] = outs
    for a, b in zip(results["0"], results["1"]):
        assert all(torch.equal(u, v) for u, v in zip(a, b))


def _tokens(path, monkeypatch, pdl: str, **kw) -> list[list[int]]:
    return greedy_tokens(path, monkeypatch, {"KESTREL_PDL": pdl}, max_tokens=48, **kw)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_engine_tokens_identical_with_and_without_pdl(checkpoint_factory, monkeypatch, arch):
    monkeypatch.setenv("KESTREL_SKINNY_MATMUL", "all")   # every decode matmul a PDL kernel
    path = str(checkpoint_factory(arch))
    assert _tokens(path, monkeypatch, "1", dtype="bfloat16") == _tokens(path, monkeypatch, "0", dtype="bfloat16")


def test_default_model_tokens_identical_with_and_without_pdl(monkeypatch):
    # Same kernels, same sums: bf16 too must match exactly (unlike changes of kernel, no near-tie can flip).
    assert _tokens(None, monkeypatch, "1") == _tokens(None, monkeypatch, "0")


@pytest.mark.parametrize("arch", ["qwen3", None])   # a random checkpoint and the default model
def test_reads_before_the_wait_are_bit_identical_under_pdl(checkpoint_factory, monkeypatch, arch):
    """Decode attention reads the first K/V tile before the PDL wait while the prologue kernel is still writing
    the newest token's row. A race would show as a token difference against launches in stream order."""
    path = str(checkpoint_factory(arch)) if arch else None
    kw = {"dtype": "bfloat16"} if arch else {}
    fast = greedy_tokens(path, monkeypatch, {"KESTREL_PDL": "1"}, max_tokens=48, **kw)
    plain = greedy_tokens(path, monkeypatch, {"KESTREL_PDL": "0"}, max_tokens=48, **kw)
    assert fast == plain
