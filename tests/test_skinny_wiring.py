"""The small-batch layer path (layers/skinny.py) wired into the model: with torch stand-ins for the fused kernels
(the kernels themselves are held to these compositions in tests/test_gemv.py), every choice of Triton-or-cuBLAS
per weight shape gives exactly the unfused model's logits and greedy tokens."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kestrel import LLM, SamplingParams
from kestrel.layers.norm import rms_norm_torch
from kestrel.layers.cuda_gemv import add_rms_norm_gemv_rope_ref, add_rms_norm_gemv_silu_ref
from kestrel.layers.skinny import CudaSkinny, SkinnyMatmuls
from kestrel.engine.fast_path import enable_fused_attn_prologue
from kestrel.layers.attention_prologue import qk_norm_rope_store_ref
from kestrel.models.llama import DecoderLayer


def _add_rms_norm_linear(x, residual, norm_weight, eps, w, bias=None):
    h = x if residual is None else x + residual
    return F.linear(rms_norm_torch(h, norm_weight, eps), w, bias), h


def _silu_mul_linear(gate_up, w, bias=None):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w, bias)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2"])
@pytest.mark.parametrize("choice", ["all", "none", "mixed", "cuda", "cuda_rope"])
def test_skinny_path_matches_the_layer_path(checkpoint_factory, arch, choice):
    path = str(checkpoint_factory(arch))
    prompts = ["def f(x):", "import os\nimport sys", "x"]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    plain = LLM(model=path, device="cpu")
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    ref_logits = plain.engine.prompt_logits([5, 6, 7])
    use = {"all": lambda m, n, k: True, "none": lambda m, n, k: False, "mixed": lambda m, n, k: n > k,
           "cuda": lambda m, n, k: False, "cuda_rope": lambda m, n, k: False}[choice]
    calls = []
    # "cuda": every matmul through the CudaSkinny slots (SiLU-mul folded into gate_up, down a plain matmul);
    # "cuda_rope": also the attention prologue, through the fused-prologue path, folded into the QKV projection
    # on decode steps of models without q/k norm (llama, qwen2; qwen3 keeps the prologue)
    def rope(*args, **kw):
        calls.append("rope")
        return add_rms_norm_gemv_rope_ref(*args, **kw)

    cuda = CudaSkinny(gemv=lambda x, w, b=None: calls.append("cuda") or F.linear(x, w, b),
                      add_rms_norm_gemv=_add_rms_norm_linear, add_rms_norm_gemv_silu=add_rms_norm_gemv_silu_ref,
                      use=lambda x, w, norm: True,
                      add_rms_norm_gemv_rope=rope if choice == "cuda_rope" else None) \
        if choice.startswith("cuda") else None
    skinny = SkinnyMatmuls(max_rows=4, gemv=lambda x, w, b=None: calls.append("gemv") or F.linear(x, w, b),
                           add_rms_norm_gemv=_add_rms_norm_linear, silu_mul_gemv=_silu_mul_linear, use_triton=use,
                           cuda=cuda)
    llm = LLM(model=path, device="cpu")
    if choice == "cuda_rope":
        enable_fused_attn_prologue(llm.engine.runner.model, llm.engine.runner.backend, qk_norm_rope_store_ref)
    for module in llm.engine.runner.model.modules():
        if isinstance(module, DecoderLayer):
            module.skinny = skinny
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]   # decode steps: 3 rows, skinny
    assert got == expected
    torch.testing.assert_close(llm.engine.prompt_logits([5, 6, 7]), ref_logits, rtol=0, atol=0)  # 3 rows too
    # o_proj is square-ish: only "all" sends it to gemv; "cuda" sends o_proj and down_proj to its gemv
    folds = {"cuda"} if arch == "qwen3" else {"cuda", "rope"}
    assert set(calls) == {"all": {"gemv"}, "cuda": {"cuda"}, "cuda_rope": folds}.get(choice, set())


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


def test_cuda_skinny_policy(monkeypatch):
    """KESTREL_CUDA_GEMV: 0 builds nothing; auto (the default) / all take weights above the Triton cap / any
    weight, never on CPU (the kernels need a Hopper GPU); other values are refused."""
    from kestrel.engine.fast_path import cuda_skinny
    assert cuda_skinny("0", 16 << 20) is None
    with pytest.raises(ValueError, match="KESTREL_CUDA_GEMV"):
        cuda_skinny("yes", 16 << 20)
    x, w = torch.zeros(1, 4096, dtype=torch.bfloat16), torch.zeros(6144, 4096, dtype=torch.bfloat16)
    assert cuda_skinny("all", 16 << 20).use(x, w, True) is False
