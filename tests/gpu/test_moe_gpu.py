"""Mixture of experts and latent attention on CUDA (issue #35): the fused Triton MoE kernel (compiled, bf16 on the
tensor cores) against the torch reference at real layer shapes, with no host sync so a CUDA graph can hold it; MLA's
absorbed decode form on the GPU against the definition; and the engine's greedy tokens with decode graphs equal to
eager, and with the fused MoE equal to the torch experts.

Same contracts as tests/test_fused_moe.py and tests/test_mla.py (there under Triton's interpreter / on the CPU).
Written without a GPU at hand: the first GPU run is its first run. The engine tests run in float32, where every
road computes the same sums to ~1e-6 and greedy tokens must match exactly; bf16 is the kernel tests' case."""
from __future__ import annotations

import pytest
import torch

from kestrel.layers.moe import fused_experts_torch
from tests.gpu.engine_tokens import PROMPTS
from tests.gpu.timing import time_us

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

LAYERS = {  # name: (experts, top-k, hidden, expert width)
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "deepseek-v3-small": (64, 6, 2048, 1408),
}
# bf16: both sides multiply the same bf16 operands with float32 sums and round the same intermediates to bf16
# (silu(gate) * up, each expert's output) at slightly different points, each a 2^-8 relative step; the weighted
# sum of k experts is float32 on both. 1% of the largest output plus 2% relative covers that with room.
BF16_RTOL, BF16_ATOL_OF_MAX = 2e-2, 1e-2


def problem(tokens: int, experts: int, topk: int, hidden: int, inter: int, pick: list[int] | None = None,
            seed: int = 0, dtype: torch.dtype = torch.bfloat16):
    """Fresh random inputs on CUDA, weights at checkpoint scale (std 0.02); pick: the experts routing may choose
    (the rest receive no tokens)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, hidden, device="cuda", generator=g).to(dtype)
    w13 = (0.02 * torch.randn(experts, 2 * inter, hidden, device="cuda", generator=g)).to(dtype)
    w2 = (0.02 * torch.randn(experts, hidden, inter, device="cuda", generator=g)).to(dtype)
    allowed = torch.tensor(pick if pick is not None else list(range(experts)), device="cuda")
    scores = torch.rand(tokens, len(allowed), device="cuda", generator=g)
    ids = allowed[scores.topk(topk, dim=-1).indices]
    weights = torch.softmax(torch.randn(tokens, topk, device="cuda", generator=g), dim=-1)
    return x, w13, w2, ids, weights


def assert_close_bf16(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.dtype == ref.dtype and ours.shape == ref.shape
    torch.testing.assert_close(ours.float(), ref.float(), rtol=BF16_RTOL,
                               atol=BF16_ATOL_OF_MAX * ref.float().abs().max().item())


@pytest.mark.parametrize("path", ["rows", "tiles"])
@pytest.mark.parametrize("tokens", [1, 2, 3, 4, 5, 8, 64, 512, 2048])
@pytest.mark.parametrize("layer", list(LAYERS))
def test_fused_moe_matches_torch_reference(layer, tokens, path):
    """Decode (1 .. 8 tokens: nearly every expert idle) and prefill sizes, random routing, both paths (the rows
    path is the default up to ROWS_PATH_MAX (token, slot) rows, the tiles path past it)."""
    from kestrel.kernels.triton.fused_moe import fused_experts_triton

    experts, topk, hidden, inter = LAYERS[layer]
    x, w13, w2, ids, weights = problem(tokens, experts, topk, hidden, inter, seed=tokens)
    assert_close_bf16(fused_experts_triton(x, w13, w2, ids, weights, path=path),
                      fused_experts_torch(x, w13, w2, ids, weights))


@pytest.mark.parametrize("path", ["rows", "tiles"])
@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_fused_moe_with_most_experts_idle_and_all_tokens_on_the_same_experts(tokens, path):
    """Every token picks the same top-8 (one expert's run holds all T rows, 120 experts get none), and top-1 with
    every token on expert 77 (the longest possible run of one expert)."""
    from kestrel.kernels.triton.fused_moe import fused_experts_triton

    experts, topk, hidden, inter = LAYERS["qwen3-30b-a3b"]
    same = [3, 17, 40, 41, 64, 100, 126, 127]
    x, w13, w2, ids, weights = problem(tokens, experts, topk, hidden, inter, pick=same, seed=1)
    assert_close_bf16(fused_experts_triton(x, w13, w2, ids, weights, path=path),
                      fused_experts_torch(x, w13, w2, ids, weights))
    x, w13, w2, ids, weights = problem(tokens, experts, 1, hidden, inter, pick=[77], seed=2)
    assert bool((ids == 77).all())
    assert_close_bf16(fused_experts_triton(x, w13, w2, ids, weights, path=path),
                      fused_experts_torch(x, w13, w2, ids, weights))


@pytest.mark.parametrize("path", ["rows", "tiles"])
def test_fused_moe_float32_is_exact_enough_for_parity(path):
    """float32 models (the engine tests below): float32 products and sums (the tiles path's dots "ieee", not TF32),
    the reference's to float32 rounding."""
    from kestrel.kernels.triton.fused_moe import fused_experts_triton

    x, w13, w2, ids, weights = problem(9, 16, 4, 256, 96, seed=3, dtype=torch.float32)
    torch.testing.assert_close(fused_experts_triton(x, w13, w2, ids, weights, path=path),
                               fused_experts_torch(x, w13, w2, ids, weights), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("path", ["rows", "tiles"])
def test_fused_moe_makes_no_host_sync(path):
    """No .item(), .tolist(), nonzero or data-sized bincount: torch's sync debug mode raises on any of them."""
    from kestrel.kernels.triton.fused_moe import fused_experts_triton

    x, w13, w2, ids, weights = problem(4, *LAYERS["qwen3-30b-a3b"], seed=4)
    fused_experts_triton(x, w13, w2, ids, weights, path=path)   # compile outside the checked region
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fused_experts_triton(x, w13, w2, ids, weights, path=path)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.mark.parametrize("tokens", [1, 8, 128])
def test_fused_moe_replays_in_a_cuda_graph_with_new_routing(tokens):
    """Captured once, replayed after the routing and the inputs changed in place: the sizes are fixed by T, k and E
    alone, so one graph serves every routing of T tokens (1 and 8 tokens: the rows path; 128: the tiles)."""
    from kestrel.kernels.triton.fused_moe import fused_experts_triton

    experts, topk, hidden, inter = LAYERS["qwen3-30b-a3b"]
    x, w13, w2, ids, weights = problem(tokens, experts, topk, hidden, inter, seed=5)
    fused_experts_triton(x, w13, w2, ids, weights)   # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_experts_triton(x, w13, w2, ids, weights)
    x2, _, _, ids2, weights2 = problem(tokens, experts, topk, hidden, inter, pick=list(range(0, experts, 3)), seed=6)
    x.copy_(x2)
    ids.copy_(ids2)
    weights.copy_(weights2)
    graph.replay()
    torch.cuda.synchronize()
    assert_close_bf16(out, fused_experts_torch(x, w13, w2, ids, weights))


@pytest.mark.parametrize("tokens", [1, 8, 128, 2048])
def test_softmax_topk_kernel_matches_reference_and_replays_in_a_graph(tokens):
    """The one-launch routing (kernels/triton/moe_routing.py) at Qwen3-30B-A3B's 128 experts, top-8: the same
    experts in the same order, weights to float32 rounding; captured and replayed on new logits."""
    from kestrel.kernels.triton.moe_routing import softmax_topk_triton
    from kestrel.layers.moe import softmax_topk

    g = torch.Generator(device="cuda").manual_seed(tokens)
    logits = torch.randn(tokens, 128, device="cuda", generator=g)
    ours, ref = softmax_topk_triton(logits, 8, True), softmax_topk(logits, 8, True)
    assert torch.equal(ours.topk_ids, ref.topk_ids)
    torch.testing.assert_close(ours.topk_weights, ref.topk_weights, rtol=1e-5, atol=1e-6)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = softmax_topk_triton(logits, 8, True)
    logits.copy_(torch.randn(tokens, 128, device="cuda", generator=g))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured.topk_ids, softmax_topk(logits, 8, True).topk_ids)



@pytest.mark.parametrize("tokens", [1, 8, 16, 64])
def test_router_gemv_kernel_matches_float32_router_and_replays_in_a_graph(tokens):
    """The router GEMV folded into the Triton routing (moe_routing.router_softmax_topk_triton) at Qwen3-30B-A3B's
    128 x 2048 float32 router, bf16 hidden states: Router's float32 logits to float32 rounding, the reference
    routing's experts in order; captured and replayed on new hidden states (64 tokens: the cuBLAS road)."""
    from kestrel.kernels.triton.moe_routing import router_logits_triton, router_softmax_topk_triton
    from kestrel.layers.moe import softmax_topk

    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, 2048, device="cuda", generator=g).to(torch.bfloat16)
    weight = 0.02 * torch.randn(128, 2048, device="cuda", generator=g)
    ref_logits = torch.nn.functional.linear(x.float(), weight)
    torch.testing.assert_close(router_logits_triton(x, weight), ref_logits, rtol=1e-5, atol=1e-5)
    ours, ref = router_softmax_topk_triton(x, weight, 8, True), softmax_topk(ref_logits, 8, True)
    assert torch.equal(ours.topk_ids, ref.topk_ids)
    torch.testing.assert_close(ours.topk_weights, ref.topk_weights, rtol=1e-5, atol=1e-6)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = router_softmax_topk_triton(x, weight, 8, True)
    x.copy_(torch.randn(tokens, 2048, device="cuda", generator=g).to(torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured.topk_ids,
                       softmax_topk(torch.nn.functional.linear(x.float(), weight), 8, True).topk_ids)

def _time_us(fn, iters: int = 100) -> float:
    return time_us(fn, iters, warmup=5)


def _copy_gb_s() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / _time_us(lambda: dst.copy_(src), 10) / 1e3


def test_fused_moe_layer_times_printed(capsys):
    """Not a pass/fail figure: one Qwen3-30B-A3B MoE layer's experts at decode sizes, each path, as µs and the GB/s
    of the expert weights it reads (E (1 - (1 - k/E)^T) experts of 3 x 2048 x 768 bf16), next to a device copy's
    rate (read + written); and the routing ops before it (router GEMV in float32, softmax, top-k, renormalise)."""
    from benchmarks.moe_roofline import expected_touched_experts
    from kestrel.kernels.triton.fused_moe import fused_experts_triton
    from kestrel.layers.moe import softmax_topk

    experts, topk, hidden, inter = LAYERS["qwen3-30b-a3b"]
    rows = [f"device copy: {_copy_gb_s():,.0f} GB/s (read + written)"]
    expert_bytes = 3 * hidden * inter * 2
    for tokens in (1, 4, 8, 32, 128):
        x, w13, w2, ids, weights = problem(tokens, experts, topk, hidden, inter, seed=tokens)
        touched = expected_touched_experts(experts, topk, tokens)
        for path in ("rows", "tiles"):
            if path == "rows" and tokens > 32:
                continue
            us = _time_us(lambda: fused_experts_triton(x, w13, w2, ids, weights, path=path))
            rows.append(f"T={tokens:<4} {path:<5} {us:8.1f} us  {touched * expert_bytes / us / 1e3:7,.0f} GB/s "
                        f"(~{touched:.1f} experts)")
    router = torch.randn(experts, hidden, device="cuda") * 0.02
    x = torch.randn(1, hidden, device="cuda").to(torch.bfloat16)
    from kestrel.kernels.triton.moe_routing import softmax_topk_triton
    for name, route in (("torch", softmax_topk), ("triton", softmax_topk_triton)):
        us = _time_us(lambda: route(torch.nn.functional.linear(x.float(), router), topk, True))
        rows.append(f"routing, T=1, router GEMV + softmax top-k ({name}), eager launches: {us:.1f} us")
    from kestrel.kernels.triton.moe_routing import router_softmax_topk_triton
    us = _time_us(lambda: router_softmax_topk_triton(x, router, topk, True))
    rows.append(f"routing, T=1, router GEMV kernel + softmax top-k (triton, 2 launches), eager: {us:.1f} us")
    with capsys.disabled():
        print("\n" + "\n".join(rows))
    assert len(rows) > 3


@pytest.mark.parametrize("road", ["torch", "triton"])
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("decode_rows", [1, 8])
def test_mla_absorbed_decode_on_cuda_matches_the_definition(decode_rows, heads, road):
    """The absorbed decode form on the GPU in bf16, at DeepSeek's widths (latent 512, rope 64, nope 128, v 128;
    16 and DeepSeek-V3's 128 heads), against the float32 definition: the torch road, and the triton backend's
    split-K kernel over the 576-wide latent (kernels/triton/latent_decode.py, compiled: BLOCK_D 1024)."""
    from kestrel.attention.mla import LatentAttention, write_latent
    from kestrel.attention.triton_backend import TritonAttentionBackend
    from kestrel.batch import build_forward_batch

    nope, rope, v_dim, rank, block = 128, 64, 128, 512, 16
    g = torch.Generator(device="cuda").manual_seed(decode_rows)
    cached = [37 + 50 * i for i in range(decode_rows)]
    kv_lens = [c + 1 for c in cached]
    needed = [-(-n // block) for n in kv_lens]
    order = torch.randperm(sum(needed) + 2, device="cuda", generator=g).tolist()
    tables = []
    for n in needed:
        tables.append(order[:n])
        order = order[n:]
    cache = torch.randn(sum(needed) + 2, block, 1, rank + rope, device="cuda", generator=g).to(torch.bfloat16)
    batch = build_forward_batch([[0]] * decode_rows, cached, tables, block).to(torch.device("cuda"))
    write_latent(torch.randn(decode_rows, rank + rope, device="cuda", generator=g), cache, batch.slot_mapping)
    q_nope = torch.randn(decode_rows, heads, nope, device="cuda", generator=g)
    q_pe = torch.randn(decode_rows, heads, rope, device="cuda", generator=g)
    w_uk = 0.05 * torch.randn(heads, nope, rank, device="cuda", generator=g)
    w_uv = 0.05 * torch.randn(heads, v_dim, rank, device="cuda", generator=g)
    attn = LatentAttention(rank, (nope + rope) ** -0.5)
    bf = torch.bfloat16
    backend = TritonAttentionBackend() if road == "triton" else None
    ours = attn.absorbed(q_nope.to(bf), q_pe.to(bf), w_uk.to(bf), w_uv.to(bf), cache, batch, backend).float()
    refs = []
    for i, (table, n) in enumerate(zip(tables, kv_lens)):
        latent = torch.stack([cache[table[p // block], p % block, 0] for p in range(n)]).float()
        c_kv, k_pe = latent[:, :rank], latent[:, rank:]
        k = torch.cat([torch.einsum("kr,hnr->khn", c_kv, w_uk), k_pe[:, None].expand(-1, heads, -1)], dim=-1)
        v = torch.einsum("kr,hvr->khv", c_kv, w_uv)
        q = torch.cat([q_nope[i], q_pe[i]], dim=-1)                               # [H, nope + rope]
        p = (torch.einsum("hd,khd->hk", q, k) * attn.scale).softmax(-1)
        refs.append(torch.einsum("hk,khv->hv", p, v))
    ref = torch.stack(refs)
    torch.testing.assert_close(ours, ref, rtol=5e-2, atol=5e-2 * ref.abs().max().item())


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    from tests.test_moe_models import make_moe_checkpoint

    cache: dict[str, str] = {}

    def make(name: str) -> str:
        if name not in cache:
            cache[name] = str(make_moe_checkpoint(tmp_path_factory.mktemp(f"gpu_{name}"), name))
        return cache[name]

    return make


_RUNS: dict[tuple, tuple[list[list[int]], dict]] = {}   # one engine start per (checkpoint, switch, graphs, backend)


def _tokens(path: str, monkeypatch, fused: bool, graphs: bool = True,
            attention_backend: str | None = None) -> tuple[list[list[int]], dict]:
    """Greedy tokens of PROMPTS, float32, with the fused MoE on or off and decode graphs on or off (and an
    attention backend other than the default, if named); and whether each graph family was captured (a failed
    capture falls back to eager silently, so it is checked here)."""
    from kestrel import LLM, SamplingParams
    from kestrel.envs import switches

    key = (path, fused, graphs, attention_backend)
    if key not in _RUNS:
        monkeypatch.setenv("KESTREL_FUSED_MOE", "1" if fused else "0")
        switches.cache_clear()
        llm = LLM(model=path, device="cuda", dtype="float32", cuda_graph_max_bs=8, max_num_seqs=8,
                  disable_cuda_graph=not graphs, attention_backend=attention_backend)
        runner = llm.engine.runner
        info = {"graphs": runner.graphs is not None, "prefill_graphs": runner.prefill_graphs is not None}
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        _RUNS[key] = ([o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)], info)
        llm.shutdown()
        switches.cache_clear()
    return _RUNS[key]


def test_qwen3_moe_graphs_keep_eager_tokens_with_the_fused_moe(moe_ckpt, monkeypatch):
    """The fused MoE captured in the decode and prefill graphs (no fallback to eager) gives eager's tokens."""
    import kestrel.kernels.triton.fused_moe as fused_moe

    _graphs_keep_eager_tokens(moe_ckpt("qwen3_moe"), monkeypatch, fused_moe, "fused_experts_triton",
                              {"graphs": True, "prefill_graphs": True})


def _graphs_keep_eager_tokens(path: str, monkeypatch, module, function: str, expected_info: dict) -> None:
    """Greedy tokens with graphs equal eager's, the graph families captured as expected_info says, and decode
    routed through module.function (counted by a wrapper, in a start of its own)."""
    calls = []
    launch = getattr(module, function)
    monkeypatch.setattr(module, function, lambda *a, **k: calls.append(1) or launch(*a, **k))
    _RUNS.pop((path, True, True, None), None)   # this test counts the calls: its own start
    graphs, info = _tokens(path, monkeypatch, fused=True)
    assert calls, f"the engine did not go through {module.__name__}.{function}"
    assert info == expected_info, f"graph families captured: {info}"
    eager, _ = _tokens(path, monkeypatch, fused=True, graphs=False)
    assert graphs == eager


def test_qwen3_moe_fused_experts_keep_the_torch_experts_tokens(moe_ckpt, monkeypatch):
    """The fused kernels (routing and experts) in graphs against the torch experts' eager sparse loop, the
    oracle (one engine start fewer than graphs on both sides: the test file's time is limited)."""
    path = moe_ckpt("qwen3_moe")
    fused, _ = _tokens(path, monkeypatch, fused=True)
    torch_eager, _ = _tokens(path, monkeypatch, fused=False, graphs=False)
    assert fused == torch_eager


def test_deepseek_v3_fused_experts_keep_the_torch_experts_tokens(moe_ckpt, monkeypatch):
    """MLA + grouped sigmoid routing + shared experts on CUDA, eager on both sides (the experts are the
    difference; MLA decodes through the triton backend's kernel on both)."""
    path = moe_ckpt("deepseek_v3")
    fused, info = _tokens(path, monkeypatch, fused=True, graphs=False)
    reference, _ = _tokens(path, monkeypatch, fused=False, graphs=False)
    assert fused == reference


def test_deepseek_v3_decode_graphs_keep_eager_tokens(moe_ckpt, monkeypatch):
    """MLA's absorbed decode through the split-K Triton kernel, captured in the decode graphs (so nothing on that
    road reads the device from the host: a capture that did would have fallen back to eager), gives eager's
    tokens; prefill graphs stay off for MLA (its up-projected form reads block ids on the host)."""
    import kestrel.kernels.triton.latent_decode as latent_decode

    _graphs_keep_eager_tokens(moe_ckpt("deepseek_v3"), monkeypatch, latent_decode, "latent_decode_attention",
                              {"graphs": True, "prefill_graphs": False})


def test_deepseek_v3_triton_latent_decode_keeps_the_torch_roads_tokens(moe_ckpt, monkeypatch):
    """The kernel in the decode graphs against the torch attention backend's eager road, where MLA runs as
    attention/mla.py's torch code (the oracle), float32."""
    path = moe_ckpt("deepseek_v3")
    graphs, _ = _tokens(path, monkeypatch, fused=True)
    torch_road, info = _tokens(path, monkeypatch, fused=True, graphs=False, attention_backend="torch")
    assert info["graphs"] is False
    assert graphs == torch_road


def test_dummy_load_format_runs_a_moe_shape_on_cuda(tmp_path, monkeypatch):
    """--load-format dummy on the GPU: config.json and the tokenizer only, bf16, graphs with the fused MoE."""
    from benchmarks.shapes import write_config_only
    from kestrel import LLM, SamplingParams
    from kestrel.envs import switches

    monkeypatch.setenv("KESTREL_FUSED_MOE", "1")
    switches.cache_clear()
    path = write_config_only("qwen3-moe-tiny", tmp_path / "tiny")
    llm = LLM(model=str(path), device="cuda", load_format="dummy", cuda_graph_max_bs=8, max_num_seqs=8)
    try:
        assert llm.engine.runner.graphs is not None
        assert llm.engine.runner.dtype == torch.bfloat16
        out = llm.generate([[5, 6, 7, 8]] * 3, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        assert all(len(o.outputs[0].token_ids) == 8 for o in out)
        assert out[0].outputs[0].token_ids == out[1].outputs[0].token_ids   # same prompt, same greedy tokens
    finally:
        llm.shutdown()
        switches.cache_clear()



ROW_SWEEP = [  # RowTiles(up_n, up_k, up_warps, down_n, down_k, down_warps); the first is row_tiles' bs1 choice
    (4, 2048, 8, 4, 256, 8),
    (4, 1024, 4, 4, 256, 4),
    (8, 1024, 8, 8, 256, 8),
    (2, 2048, 4, 2, 256, 4),
    (16, 256, 4, 8, 128, 4),
    (4, 2048, 8, 8, 128, 8),
]


def test_rows_path_bs1_tiles_sweep_in_a_cuda_graph_printed(capsys):
    """Not a pass/fail figure (each config is checked against the reference, though): the rows path at
    Qwen3-30B-A3B's bs1 (one token, top-8 of 128) replayed in a CUDA graph of 16 calls whose routings are
    disjoint (16 x 8 = all 128 experts), so each call reads its experts' 25 + 12.6 MB from HBM, not from the
    50 MB L2 a repeated routing would sit in. Prints us a call and the GB/s of its 8 experts' weights, per config,
    next to the device copy's rate (read + written)."""
    from kestrel.kernels.triton.fused_moe import RowTiles, fused_experts_triton, row_tiles

    experts, topk, hidden, inter = LAYERS["qwen3-30b-a3b"]
    x, w13, w2, _, _ = problem(1, experts, topk, hidden, inter, seed=11)
    perm = torch.randperm(experts, device="cuda", generator=torch.Generator(device="cuda").manual_seed(3))
    routings = [(perm[i * topk:(i + 1) * topk].view(1, topk).contiguous(),
                 torch.softmax(torch.randn(1, topk, device="cuda"), dim=-1)) for i in range(experts // topk)]
    expert_bytes = topk * 3 * hidden * inter * 2
    rows = [f"device copy: {_copy_gb_s():,.0f} GB/s (read + written); default {row_tiles(topk, hidden, inter)}"]
    for cfg in ROW_SWEEP:
        tiles = RowTiles(*cfg)
        for ids, weights in routings[:2]:
            assert_close_bf16(fused_experts_triton(x, w13, w2, ids, weights, path="rows", row_config=tiles),
                              fused_experts_torch(x, w13, w2, ids, weights))
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for ids, weights in routings:
                fused_experts_triton(x, w13, w2, ids, weights, path="rows", row_config=tiles)
        us = _time_us(graph.replay, 20) / len(routings)
        rows.append(f"{tiles}: {us:6.1f} us a layer, {expert_bytes / us / 1e3:6,.0f} GB/s")
    with capsys.disabled():
        print("\n" + "\n".join(rows))
