"""KESTREL_L2_PREFETCH (layers/l2_prefetch.py) asks L2 to fetch later matmuls' weights; it writes nothing, so the
skinny kernels and whole engines must give bit-identical results with it on and off. A bad address or size
would fault here rather than pass."""
from __future__ import annotations

import pytest
import torch

from tests.gpu.engine_tokens import switch_keeps_tokens

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_prefetch_is_on_only_with_the_switch_on_hopper(monkeypatch):
    from kestrel.layers.l2_prefetch import l2_prefetch_enabled
    hopper = torch.cuda.get_device_capability()[0] >= 9
    monkeypatch.setenv("KESTREL_L2_PREFETCH", "1")
    assert l2_prefetch_enabled(torch.device("cuda")) == hopper
    monkeypatch.setenv("KESTREL_PDL", "0")   # independent of PDL's own switch
    assert l2_prefetch_enabled(torch.device("cuda")) == hopper
    monkeypatch.setenv("KESTREL_L2_PREFETCH", "0")
    assert not l2_prefetch_enabled(torch.device("cuda"))


@pytest.mark.parametrize("rows", [1, 4])
def test_skinny_kernels_with_prefetch_regions_are_bit_identical(monkeypatch, rows):
    from kestrel.layers import gemv
    gen = torch.Generator(device="cuda").manual_seed(rows)
    dt = torch.bfloat16

    def rand(*shape):
        return (torch.randn(*shape, generator=gen, device="cuda") * 0.05).to(dt)
    x, res, norm_w, gate_up = rand(rows, 1024), rand(rows, 1024), 1 + rand(1024), rand(rows, 6144)
    w, w_o, w_gate_up, w_down = rand(4096, 1024), rand(1024, 2048), rand(6144, 1024), rand(1024, 3072)  # 0.6B
    results = {}
    for on in ("0", "1"):
        monkeypatch.setenv("KESTREL_L2_PREFETCH", on)
        qkv, res_out = gemv.add_rms_norm_gemv(x, res, norm_w, 1e-6, w, prefetch=(w_o, w_gate_up))
        o = gemv.gemv(qkv[:, :2048].contiguous(), w_o, prefetch=(w_down,))
        down = gemv.silu_mul_gemv(gate_up, w_down, prefetch=(w,))
        results[on] = (qkv, res_out, o, down)
    assert all(torch.equal(a, b) for a, b in zip(results["0"], results["1"]))


@pytest.mark.parametrize("arch", ["qwen3", None])   # a random checkpoint (bf16) and the default model
def test_engine_tokens_identical_with_and_without_l2_prefetch(checkpoint_factory, monkeypatch, arch):
    assert switch_keeps_tokens(checkpoint_factory, monkeypatch, arch, "KESTREL_L2_PREFETCH")


def test_engine_tokens_identical_with_the_standalone_prefetch_launch(checkpoint_factory, monkeypatch):
    """KESTREL_SKINNY_MAX_MB=0 puts every matmul on cuBLAS (as for the 8B), so o_proj's prefetch is a launch of its
    own before attention."""
    monkeypatch.setenv("KESTREL_SKINNY_MAX_MB", "0")
    assert switch_keeps_tokens(checkpoint_factory, monkeypatch, "llama", "KESTREL_L2_PREFETCH")
