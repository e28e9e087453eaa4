"""The CUDA C++ skinny matmuls (kestrel/kernels/cuda/cuda_gemv.py) agree with gemv.py's torch references on fresh random inputs:
the Llama-3.1-8B's layer shapes and small odd ones, 1 to 4 rows, with and without bias and residual, every row
split the config table can pick, CUDA-graph replay with new inputs, and whole engines with the kernels on and off.
As in test_gemv_gpu.py, most bf16 outputs are bit-equal and the rest within two ulps of the largest output (the
sum order differs from cuBLAS'); the residual stream is bit-equal."""
from __future__ import annotations

import pytest
import torch

from kestrel.kernels.cuda import cuda_gemv
from kestrel.kernels.triton import gemv
from kestrel.layers import skinny
from tests.gpu.engine_tokens import greedy_tokens, routed_tokens_on_and_off
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
    monkeypatch.setattr(skinny, "CUDA_GEMV_MAX_ROWS", 4)   # the 4-sequence decode batches too
    monkeypatch.setattr(skinny, "FOLD_ROPE", False)        # the matmuls alone (the fold: tests below)
    on, off = routed_tokens_on_and_off(path, monkeypatch, cuda_gemv, "add_rms_norm_gemv_silu",
                                       "KESTREL_CUDA_GEMV", "all", "0", dtype="bfloat16")
    same = sum(a == b for x, y in zip(on, off) for a, b in zip(x, y)) / sum(len(x) for x in off)
    print(f"cuda skinny matmuls {arch}: {same:.1%} of greedy tokens identical")
    assert all(x[:2] == y[:2] for x, y in zip(on, off)) and same > 0.5


ROPE_SHAPES = {"8b": (4096, 32, 8, 128), "small": (256, 4, 2, 64)}   # K, heads, kv heads, head_dim


def _rope_case(shape: str, m: int, with_residual: bool = True):
    """Inputs for add_rms_norm_gemv_rope at random positions; row 1's slot is -1 (padding) when m > 1; bias on
    the small shape; two copies of random caches (kernel, reference)."""
    from kestrel.layers.rotary import RotaryEmbedding

    k, heads, kv_heads, dim = ROPE_SHAPES[shape]
    n = (heads + 2 * kv_heads) * dim
    t = cuda_inputs(m, k, n, torch.bfloat16, seed=500 + m, with_bias=shape == "small")
    rotary = RotaryEmbedding(dim, 4096, 500000.0, None).cuda()
    gen = torch.Generator(device="cuda").manual_seed(m)
    positions = torch.randint(0, 4096, (m,), device="cuda", generator=gen)
    slots = torch.randperm(16 * 16, device="cuda", generator=gen)[:m]
    if m > 1:
        slots[1] = -1
    caches = [torch.randn(16, 16, kv_heads, dim, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(2)]
    args = (t["x"], t["residual"] if with_residual else None, t["norm_weight"], 1e-6, t["w"], t["bias"],
            positions, rotary.cos_sin_cache)
    return args, caches, slots, (heads, kv_heads, dim)


@pytest.mark.parametrize("m", [1, 2, 4])
@pytest.mark.parametrize("shape", list(ROPE_SHAPES))
def test_add_rms_norm_gemv_rope_is_the_projection_then_hf_rotary(shape, m):
    """Bit-exact: the fold's q and K/V equal this kernel's own unrotated projection (add_rms_norm_gemv) put
    through the torch prologue reference (HF's roundings: each product rounded to bf16, then the sum), and slot -1
    writes nothing; the residual stream is bit-equal too."""
    from kestrel.kernels.triton.attention_prologue import qk_norm_rope_store_ref

    args, caches, slots, heads = _rope_case(shape, m, with_residual=m != 2)
    want_caches = [c.clone() for c in caches]
    q, res_out = cuda_gemv.add_rms_norm_gemv_rope(*args, *caches, slots, *heads)
    qkv, want_res = cuda_gemv.add_rms_norm_gemv(*args[:6])
    want_q = qk_norm_rope_store_ref(qkv, None, None, 1e-6, args[6], args[7], *want_caches, slots, *heads)
    assert torch.equal(q, want_q)
    assert torch.equal(caches[0], want_caches[0]) and torch.equal(caches[1], want_caches[1])
    assert torch.equal(res_out, want_res) if args[1] is not None else res_out is args[0]


@pytest.mark.parametrize("m", [1, 4])
def test_add_rms_norm_gemv_rope_matches_the_torch_reference(m):
    """End to end against add_rms_norm_gemv_ref + the prologue reference (torch's matmul sums in another order,
    so mostly bit-equal, as the other matmul tests)."""
    args, caches, slots, heads = _rope_case("8b", m)
    want_caches = [c.clone() for c in caches]
    q, _ = cuda_gemv.add_rms_norm_gemv_rope(*args, *caches, slots, *heads)
    want_q, _ = cuda_gemv.add_rms_norm_gemv_rope_ref(*args, *want_caches, slots, *heads)
    mostly_bit_equal(q, want_q)
    written = slots[slots >= 0]
    for got, want in zip(caches, want_caches):
        mostly_bit_equal(got.flatten(0, 1)[written], want.flatten(0, 1)[written])


@pytest.mark.parametrize("arch", ["llama", "qwen2"])   # qwen2: qkv bias
def test_engine_with_the_prologue_folded_into_qkv_on_and_off(checkpoint_factory, monkeypatch, arch):
    """Every decode step's QKV projection with rotary and the K/V write folded in (skinny.FOLD_ROPE, the matmuls
    on the CUDA kernels for every weight and batch) against the same engine with the Triton prologue kernel. The
    two round rotary differently (the fold as HF, bit-exact above; the Triton prologue differs in ~20% of q/k
    elements by an ulp), so random bf16 models drift apart at near-ties: routed, and most greedy tokens
    identical."""
    path = str(checkpoint_factory(arch, hidden_size=256, intermediate_size=512, head_dim=64))
    monkeypatch.setenv("KESTREL_CUDA_GEMV", "all")
    monkeypatch.setattr(skinny, "CUDA_GEMV_MAX_ROWS", 4)
    monkeypatch.setattr(skinny, "FOLD_ROPE", False)
    off = greedy_tokens(path, monkeypatch, {}, dtype="bfloat16")
    calls = []
    fold = cuda_gemv.add_rms_norm_gemv_rope
    monkeypatch.setattr(cuda_gemv, "add_rms_norm_gemv_rope", lambda *a, **k: calls.append(1) or fold(*a, **k))
    monkeypatch.setattr(skinny, "FOLD_ROPE", True)
    on = greedy_tokens(path, monkeypatch, {}, dtype="bfloat16")
    assert calls, "decode did not go through the folded QKV kernel"
    same = sum(a == b for x, y in zip(on, off) for a, b in zip(x, y)) / sum(len(x) for x in off)
    print(f"prologue folded into qkv, {arch}: {same:.1%} of greedy tokens identical")
    assert all(x[0] == y[0] for x, y in zip(on, off)) and same > 0.5   # the first token comes from prefill


@pytest.mark.parametrize("fold", ["gemv", "norm", "norm_no_residual", "silu", "rope"])
def test_the_bulk_copied_activation_changes_no_bit(fold, monkeypatch):
    """The TMA_X build changes only how the activation reaches the block (one bulk copy into shared memory), not
    one operation: every output equals the build that reads x from global memory (the one unaligned rows get),
    bit for bit, at the 8B's shapes (one row; the bulk copy serves one row only)."""
    layer = {"gemv": "8b.down", "norm": "8b.qkv", "norm_no_residual": "8b.qkv", "silu": "8b.gate_up",
             "rope": "8b.qkv"}[fold]
    t = _bf16(1, layer, seed=300, with_bias=fold == "norm")
    residual = None if fold == "norm_no_residual" else t["residual"]

    def run() -> list[torch.Tensor]:
        if fold == "gemv":
            return [cuda_gemv.gemv(t["x"], t["w"], t["bias"])]
        args = (t["x"], residual, t["norm_weight"], 1e-6, t["w"], t["bias"])
        if fold == "silu":
            return list(cuda_gemv.add_rms_norm_gemv_silu(*args))
        if fold != "rope":
            return list(cuda_gemv.add_rms_norm_gemv(*args))
        rope_args, caches, slots, heads = _rope_case("8b", 1)
        q, res_out = cuda_gemv.add_rms_norm_gemv_rope(*rope_args, *caches, slots, *heads)
        return [q, res_out, *caches]

    assert cuda_gemv.use_bulk_copy(1, t["x"], residual)
    got = run()
    monkeypatch.setattr(cuda_gemv, "use_bulk_copy", lambda *args: False)
    want = run()
    for g, w in zip(got, want):
        assert torch.equal(g, w)
