"""The small-batch layer path (layers/skinny.py) wired into the model: with torch stand-ins for the fused kernels
(the kernels themselves are held to these compositions in tests/test_gemv.py), every choice of Triton-or-cuBLAS
per weight shape gives exactly the unfused model's logits and greedy tokens."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kestrel import LLM, SamplingParams
from kestrel.layers.norm import rms_norm_torch
from kestrel.layers.skinny import SkinnyMatmuls
from kestrel.models.llama import DecoderLayer


def _add_rms_norm_linear(x, residual, norm_weight, eps, w, bias=None, prefetch=()):
    h = x if residual is None else x + residual
    return F.linear(rms_norm_torch(h, norm_weight, eps), w, bias), h


def _silu_mul_linear(gate_up, w, bias=None, prefetch=()):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w, bias)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2"])
@pytest.mark.parametrize("choice", ["all", "none", "mixed"])
def test_skinny_path_matches_the_layer_path(checkpoint_factory, arch, choice):
    path = str(checkpoint_factory(arch))
    prompts = ["def f(x):", "import os\nimport sys", "x"]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    plain = LLM(model=path, device="cpu")
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    ref_logits = plain.engine.prompt_logits([5, 6, 7])
    use = {"all": lambda m, n, k: True, "none": lambda m, n, k: False, "mixed": lambda m, n, k: n > k}[choice]
    calls = []
    skinny = SkinnyMatmuls(max_rows=4, gemv=lambda x, w, b=None, prefetch=(): calls.append("gemv") or F.linear(x, w, b),
                           add_rms_norm_gemv=_add_rms_norm_linear, silu_mul_gemv=_silu_mul_linear, use_triton=use)
    llm = LLM(model=path, device="cpu")
    for module in llm.engine.runner.model.modules():
        if isinstance(module, DecoderLayer):
            module.skinny = skinny
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]   # decode steps: 3 rows, skinny
    assert got == expected
    torch.testing.assert_close(llm.engine.prompt_logits([5, 6, 7]), ref_logits, rtol=0, atol=0)  # 3 rows too
    assert bool(calls) == (choice == "all")   # o_proj is square-ish: only "all" sends it to gemv


@pytest.mark.parametrize("cap_mb,triton_for_8b_qkv", [(None, False), ("64", True)])
def test_skinny_weight_cap_follows_the_env(monkeypatch, cap_mb, triton_for_8b_qkv):
    """The measured policy keeps weights above 16 MB on cuBLAS; KESTREL_SKINNY_MAX_MB moves the cap (an A/B knob):
    at 64 the Llama-3.1-8B qkv (6144 x 4096, 48 MB) takes the Triton path at one row, gate_up (224 MB) does not."""
    from kestrel.engine.fast_path import skinny_matmuls
    if cap_mb is None:
        monkeypatch.delenv("KESTREL_SKINNY_MAX_MB", raising=False)
    else:
        monkeypatch.setenv("KESTREL_SKINNY_MAX_MB", cap_mb)
    policy = skinny_matmuls("auto").use_triton
    assert policy(1, 6144, 4096) is triton_for_8b_qkv
    assert policy(1, 28672, 4096) is False
    assert policy(1, 4096, 1024) is True   # Qwen3-0.6B qkv (8 MB): Triton either way


def _llm_with_planned_prefetches(path: str, skinny: SkinnyMatmuls) -> tuple[LLM, list[DecoderLayer]]:
    """A CPU LLM whose decoder layers use `skinny` and carry KESTREL_L2_PREFETCH's plan for its policy."""
    from kestrel.layers.l2_prefetch import plan_layer_prefetches
    llm = LLM(model=path, device="cpu")
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, DecoderLayer)]
    for layer in layers:
        layer.skinny = skinny
    plan_layer_prefetches(layers, skinny.use_triton)
    return llm, layers


def test_l2_prefetch_plan_reaches_each_triton_matmul_in_step_order(checkpoint_factory):
    """KESTREL_L2_PREFETCH's plan (layers/l2_prefetch.py): each layer's qkv kernel is handed o_proj and gate_up,
    o_proj down_proj, gate_up the next layer's qkv, down nothing, and no launch of its own is planned; the weights
    reach the kernels the skinny path calls and the tokens stay the unfused model's."""
    path = str(checkpoint_factory("qwen3"))
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    expected = LLM(model=path, device="cpu").generate(["def f(x):"], params)[0].outputs[0].token_ids
    handed: list[tuple[torch.Tensor, tuple]] = []

    def record(fn):
        def call(*args, prefetch=()):
            handed.append((args[4] if fn is _add_rms_norm_linear else args[1], prefetch))
            return fn(*args)
        return call
    skinny = SkinnyMatmuls(max_rows=4, gemv=record(lambda x, w, b=None: F.linear(x, w, b)),
                           add_rms_norm_gemv=record(_add_rms_norm_linear), silu_mul_gemv=record(_silu_mul_linear),
                           use_triton=lambda m, n, k: True)
    llm, layers = _llm_with_planned_prefetches(path, skinny)
    assert all(layer.l2_prefetch["attention"] == () for layer in layers)
    assert llm.generate(["def f(x):"], params)[0].outputs[0].token_ids == expected
    by_weight = {id(w): [id(t) for t in pf] for w, pf in handed}
    for i, layer in enumerate(layers):
        attn, mlp = layer.self_attn, layer.mlp
        assert by_weight[id(attn.qkv_proj.weight)] == [id(attn.o_proj.weight), id(mlp.gate_up_proj.weight)]
        assert by_weight[id(attn.o_proj.weight)] == [id(mlp.down_proj.weight)]
        after = [id(layers[i + 1].self_attn.qkv_proj.weight)] if i + 1 < len(layers) else []
        assert by_weight[id(mlp.gate_up_proj.weight)] == after
        assert by_weight[id(mlp.down_proj.weight)] == []


def test_l2_prefetch_plan_gives_o_proj_a_launch_of_its_own_when_qkv_is_on_cublas(checkpoint_factory):
    """With the 8B's policy (every weight above the cap, so qkv on cuBLAS), o_proj is fetched by a standalone
    launch before attention; on the CPU that launch is a no-op and the tokens stay the unfused model's."""
    path = str(checkpoint_factory("llama"))
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    expected = LLM(model=path, device="cpu").generate(["x = 1"], params)[0].outputs[0].token_ids
    skinny = SkinnyMatmuls(max_rows=4, gemv=lambda x, w, b=None, prefetch=(): F.linear(x, w, b),
                           add_rms_norm_gemv=_add_rms_norm_linear, silu_mul_gemv=_silu_mul_linear,
                           use_triton=lambda m, n, k: False)
    llm, layers = _llm_with_planned_prefetches(path, skinny)
    for layer in layers:
        assert [id(t) for t in layer.l2_prefetch["attention"]] == [id(layer.self_attn.o_proj.weight)]
    assert llm.generate(["x = 1"], params)[0].outputs[0].token_ids == expected
