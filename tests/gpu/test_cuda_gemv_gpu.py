"""The CUDA C++ skinny matmuls (layers/cuda_gemv.py) agree with gemv.py's torch references on fresh random inputs:
the Llama-3.1-8B's layer shapes and small odd ones, 1 to 4 rows, with and without bias and residual, every row
split the config table can pick, CUDA-graph replay with new inputs, and whole engines with the kernels on and off.
As in test_gemv_gpu.py, most bf16 outputs are bit-equal and the rest within two ulps of the largest output (the
sum order differs from cuBLAS'); the residual stream is bit-equal."""
from __future__ import annotations

import pytest
import torch

from kestrel.layers import cuda_gemv, gemv
from tests.gpu.engine_tokens import routed_tokens_on_and_off
from tests.gpu.test_gemv_gpu import LAYERS, cuda_inputs, mostly_bit_equal

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SHAPES = {name: LAYERS[name] for name in ("8b.qkv", "8b.o", "8b.gate_up", "8b.down")} | {
    "odd": (4096, 1000), "small": (256, 72)}   # N not a multiple of a block's rows; fewer rows than one block


def _bf16(m: int, layer: str, seed: int, with_bias: bool) -> dict:
    k, n = SHAPES[layer]
    return cuda_inputs(m, k, n, torch.bfloat16, seed, with_bias=with_bias)


@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("layer", list(SHAPES))
def test_gemv_matches_reference(layer, m):
    t = _bf16(m, layer, seed=m, with_bias=m == 3)
    assert cuda_gemv.usable(t["x"], t["w"])
    mostly_bit_equal(cuda_gemv.gemv(t["x"], t["w"], t["bias"]), gemv.gemv_ref(t["x"], t["w"], t["bias"]))


@pytest.mark.parametrize("m", [1, 2, 4])
@pytest.mark.parametrize("layer", ["8b.qkv", "8b.gate_up", "odd"])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_gemv_matches_reference(layer, m, with_residual):
    t = _bf16(m, layer, seed=100 + m, with_bias=m == 2)
    residual = t["residual"] if with_residual else None
    args = (t["x"], residual, t["norm_weight"], 1e-6, t["w"], t["bias"])
    out, res_out = cuda_gemv.add_rms_norm_gemv(*args)
    want, want_res = gemv.add_rms_norm_gemv_ref(*args)
    mostly_bit_equal(out, want)
    assert torch.equal(res_out, want_res) if with_residual else res_out is t["x"]


@pytest.mark.parametrize("m", [1, 3, 4])
@pytest.mark.parametrize("layer", ["8b.gate_up", "odd"])
def test_add_rms_norm_gemv_silu_matches_reference(layer, m):
    t = _bf16(m, layer, seed=200 + m, with_bias=m == 3)
    args = (t["x"], t["residual"], t["norm_weight"], 1e-6, t["w"], t["bias"])
    act, res_out = cuda_gemv.add_rms_norm_gemv_silu(*args)
    want, want_res = cuda_gemv.add_rms_norm_gemv_silu_ref(*args)
    assert act.shape == (m, t["w"].shape[0] // 2)
    mostly_bit_equal(act, want)
    assert torch.equal(res_out, want_res)


@pytest.mark.parametrize("rows,u", [(1, 1), (1, 16), (2, 4), (3, 2), (4, 4)])
def test_every_row_split_and_step_width(rows, u):
    config = cuda_gemv.CudaGemvConfig(rows=rows, u=u)
    for m in (1, 4):
        t = _bf16(m, "odd", seed=300 + rows * 10 + u, with_bias=True)
        mostly_bit_equal(cuda_gemv.gemv(t["x"], t["w"], t["bias"], config=config),
                         gemv.gemv_ref(t["x"], t["w"], t["bias"]))
        args = (t["x"], t["residual"], t["norm_weight"], 1e-6, t["w"], t["bias"])
        if rows <= 2:
            mostly_bit_equal(cuda_gemv.add_rms_norm_gemv_silu(*args, config=config)[0],
                             cuda_gemv.add_rms_norm_gemv_silu_ref(*args)[0])


def test_not_usable_off_its_contract():
    x = torch.zeros(1, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.zeros(64, 4096, device="cuda", dtype=torch.bfloat16)
    assert cuda_gemv.usable(x, w) and cuda_gemv.usable(x, w, norm=True)
    assert not cuda_gemv.usable(x.float(), w.float())                          # bf16 only
    assert not cuda_gemv.usable(torch.zeros(5, 4096, device="cuda", dtype=torch.bfloat16), w)   # > MAX_M rows
    assert not cuda_gemv.usable(x[:, :4000], w[:, :4000])                      # K not a multiple of 256
    big = torch.zeros(1, 8192, device="cuda", dtype=torch.bfloat16)
    assert not cuda_gemv.usable(big, torch.zeros(64, 8192, device="cuda", dtype=torch.bfloat16), norm=True)


@pytest.mark.parametrize("m", [1, 4])
def test_captured_in_a_cuda_graph_replays_new_inputs(m):
    t = _bf16(m, "8b.gate_up", seed=400, with_bias=False)
    k, n = SHAPES["8b.gate_up"]
    w_down = (torch.randn(k, n // 2, device="cuda") / (n // 2) ** 0.5).to(torch.bfloat16)
    args = (t["x"], t["residual"], t["norm_weight"], 1e-6, t["w"])

    def step():
        act, res_out = cuda_gemv.add_rms_norm_gemv_silu(*args)
        return act, res_out, cuda_gemv.gemv(act, w_down)

    step()                                      # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        act, res_out, down = step()
    for seed in (1, 2):
        new = _bf16(m, "8b.gate_up", seed=400 + seed, with_bias=False)
        t["x"].copy_(new["x"])
        t["residual"].copy_(new["residual"])
        graph.replay()
        want_act, want_res = cuda_gemv.add_rms_norm_gemv_silu_ref(*args)
        mostly_bit_equal(act, want_act)
        assert torch.equal(res_out, want_res)
        mostly_bit_equal(down, gemv.gemv_ref(act, w_down))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])   # qwen2: qkv bias
def test_engine_with_the_cuda_matmuls_on_and_off(checkpoint_factory, monkeypatch, arch):
    """A bf16 engine whose every decode matmul runs here (KESTREL_CUDA_GEMV=all) against the default path:
    greedy tokens (bf16 near-ties aside)."""
    path = str(checkpoint_factory(arch, hidden_size=256, intermediate_size=512, head_dim=64))
    monkeypatch.setenv("KESTREL_CUDA_GEMV_MAX_ROWS", "4")   # the 4-sequence decode batches too
    on, off = routed_tokens_on_and_off(path, monkeypatch, cuda_gemv, "add_rms_norm_gemv_silu",
                                       "KESTREL_CUDA_GEMV", "all", "0", dtype="bfloat16")
    same = sum(a == b for x, y in zip(on, off) for a, b in zip(x, y)) / sum(len(x) for x in off)
    print(f"cuda skinny matmuls {arch}: {same:.1%} of greedy tokens identical")
    assert all(x[:2] == y[:2] for x, y in zip(on, off)) and same > 0.5


ROPE_SHAPES = {"8b": (4096, 32, 8, 128), "small": (256, 4, 2, 64)}   # K, heads, kv heads, head_dim


@pytest.mark.parametrize("m", [1, 2, 4])
@pytest.mark.parametrize("shape", list(ROPE_SHAPES))
def test_add_rms_norm_gemv_rope_matches_reference(shape, m):
    """q, the written K/V and the residual stream against add_rms_norm_gemv_ref + the prologue's reference, at
    random positions, one row's slot -1 (padding: nothing written) when m > 1, with bias on the small shape."""
    from kestrel.layers.rotary import RotaryEmbedding

    k, heads, kv_heads, dim = ROPE_SHAPES[shape]
    n = (heads + 2 * kv_heads) * dim
    t = cuda_inputs(m, k, n, torch.bfloat16, seed=500 + m, with_bias=shape == "small")
    rotary = RotaryEmbedding(dim, 4096, 500000.0, None).cuda()
    gen = torch.Generator(device="cuda").manual_seed(m)
    positions = torch.randint(0, 4096, (m,), device="cuda", generator=gen)
    blocks, block_size = 16, 16
    slots = torch.randperm(blocks * block_size, device="cuda", generator=gen)[:m]
    if m > 1:
        slots[1] = -1
    caches = [torch.randn(blocks, block_size, kv_heads, dim, device="cuda", generator=gen).to(torch.bfloat16)
              for _ in range(2)]
    caches += [c.clone() for c in caches]   # the reference writes into copies of the same caches
    args = (t["x"], t["residual"], t["norm_weight"], 1e-6, t["w"], t["bias"], positions, rotary.cos_sin_cache)
    heads_args = (heads, kv_heads, dim)
    q, res_out = cuda_gemv.add_rms_norm_gemv_rope(*args, caches[0], caches[1], slots, *heads_args)
    want_q, want_res = cuda_gemv.add_rms_norm_gemv_rope_ref(*args, caches[2], caches[3], slots, *heads_args)
    mostly_bit_equal(q, want_q)
    assert torch.equal(res_out, want_res)
    for got, want in ((caches[0], caches[2]), (caches[1], caches[3])):
        mostly_bit_equal(got.view(-1, kv_heads, dim)[slots[slots >= 0]], want.view(-1, kv_heads, dim)[slots[slots >= 0]])
        untouched = torch.ones(blocks * block_size, dtype=torch.bool, device="cuda")
        untouched[slots[slots >= 0]] = False
        assert torch.equal(got.view(-1, kv_heads, dim)[untouched], want.view(-1, kv_heads, dim)[untouched])


@pytest.mark.parametrize("arch", ["llama", "qwen2"])   # qwen2: qkv bias
def test_engine_with_the_prologue_folded_into_qkv_on_and_off(checkpoint_factory, monkeypatch, arch):
    """Every decode step's QKV projection with rotary and the K/V write folded in (KESTREL_CUDA_GEMV_ROPE=1, the
    matmuls on the CUDA kernels for every weight and batch) against the same engine with the prologue kernel:
    greedy tokens (bf16 near-ties aside)."""
    path = str(checkpoint_factory(arch, hidden_size=256, intermediate_size=512, head_dim=64))
    monkeypatch.setenv("KESTREL_CUDA_GEMV", "all")
    monkeypatch.setenv("KESTREL_CUDA_GEMV_MAX_ROWS", "4")
    on, off = routed_tokens_on_and_off(path, monkeypatch, cuda_gemv, "add_rms_norm_gemv_rope",
                                       "KESTREL_CUDA_GEMV_ROPE", "1", "0", dtype="bfloat16")
    same = sum(a == b for x, y in zip(on, off) for a, b in zip(x, y)) / sum(len(x) for x in off)
    print(f"prologue folded into qkv, {arch}: {same:.1%} of greedy tokens identical")
    assert all(x[:2] == y[:2] for x, y in zip(on, off)) and same > 0.5
