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


def _add_rms_norm_linear(x, residual, norm_weight, eps, w, bias=None):
    h = x if residual is None else x + residual
    return F.linear(rms_norm_torch(h, norm_weight, eps), w, bias), h


def _silu_mul_linear(gate_up, w, bias=None):
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
    skinny = SkinnyMatmuls(max_rows=4, gemv=lambda x, w, b=None: calls.append("gemv") or F.linear(x, w, b),
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


def test_column_linear_is_the_same_matmul_at_one_row_and_linear_otherwise():
    from kestrel.layers.skinny import column_linear
    torch.manual_seed(0)
    for bias in (False, True):
        linear = torch.nn.Linear(64, 48, bias=bias)
        x = torch.randn(1, 64)
        got = column_linear(x, linear)
        assert got.shape == (1, 48) and got.is_contiguous()
        torch.testing.assert_close(got, linear(x), rtol=1e-6, atol=1e-6)
        rows = torch.randn(3, 64)
        assert torch.equal(column_linear(rows, linear), linear(rows))


def test_one_row_decode_through_column_cublas_keeps_the_greedy_tokens(checkpoint_factory, monkeypatch):
    """KESTREL_CUBLAS_COLUMN=1 (an A/B knob) sends every one-row matmul that Triton does not take through
    column_linear; a lone prompt's decode steps are one row, and its greedy tokens stay those of the plain path."""
    from kestrel.engine.fast_path import skinny_matmuls
    from kestrel.layers.skinny import column_linear, plain_linear
    monkeypatch.setenv("KESTREL_CUBLAS_COLUMN", "1")
    column = skinny_matmuls("auto")
    assert column.cublas is column_linear
    monkeypatch.delenv("KESTREL_CUBLAS_COLUMN")
    assert skinny_matmuls("auto").cublas is plain_linear
    path = str(checkpoint_factory("llama"))
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    expected = LLM(model=path, device="cpu").generate(["def f(x):"], params)[0].outputs[0].token_ids
    calls = []

    def counted(x, linear):
        calls.append(x.shape[0])
        return column_linear(x, linear)

    skinny = SkinnyMatmuls(max_rows=4, gemv=F.linear, add_rms_norm_gemv=_add_rms_norm_linear,
                           silu_mul_gemv=_silu_mul_linear, use_triton=lambda m, n, k: False, cublas=counted)
    llm = LLM(model=path, device="cpu")
    for module in llm.engine.runner.model.modules():
        if isinstance(module, DecoderLayer):
            module.skinny = skinny
    assert llm.generate(["def f(x):"], params)[0].outputs[0].token_ids == expected
    assert calls and set(calls) == {1}   # every decode step's matmuls took the column path
