"""The decode-sized linear method (layers/skinny.py) inside the model: with torch stand-ins for the fused kernels
(the kernels themselves are held to these compositions in tests/test_gemv.py), every choice of Triton-or-cuBLAS
per weight shape gives exactly the plain method's logits and greedy tokens."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kestrel import LLM, SamplingParams
from kestrel.layers.norm import rms_norm_torch
from kestrel.kernels.cuda.cuda_gemv import add_rms_norm_gemv_rope_ref, add_rms_norm_gemv_silu_ref
from kestrel.layers.linear import LinearBase
from kestrel.layers.skinny import CudaSkinny, SkinnyLinearMethod, cuda_skinny, skinny_policy
from kestrel.kernels.triton.attention_prologue import qk_norm_rope_store_ref


def _add_rms_norm_linear(x, residual, norm_weight, eps, w, bias=None):
    h = x if residual is None else x + residual
    return F.linear(rms_norm_torch(h, norm_weight, eps), w, bias), h


def _silu_mul_linear(gate_up, w, bias=None):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w, bias)


@pytest.mark.slow
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
    skinny = SkinnyLinearMethod(max_rows=4, gemv=lambda x, w, b=None: calls.append("gemv") or F.linear(x, w, b),
                                add_rms_norm_gemv=_add_rms_norm_linear, silu_mul_gemv=_silu_mul_linear,
                                use_triton=use, cuda=cuda)
    llm = LLM(model=path, device="cpu")
    model = llm.engine.runner.model
    if choice == "cuda_rope":
        assert llm.engine.runner.backend.supports_prewritten_kv()
        for layer in model.layers:
            layer.self_attn.prologue = qk_norm_rope_store_ref
    for module in model.modules():
        if isinstance(module, LinearBase):
            module.method = skinny
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]   # decode steps: 3 rows, skinny
    assert got == expected
    # 3 rows too; exact: on the CPU the skinny methods run their references, the plain road's ops in its order
    torch.testing.assert_close(llm.engine.prompt_logits([5, 6, 7]), ref_logits, rtol=0, atol=0)
    # o_proj is square-ish: only "all" sends it to gemv; "cuda" sends o_proj and down_proj to its gemv
    folds = {"cuda"} if arch == "qwen3" else {"cuda", "rope"}
    assert set(calls) == {"all": {"gemv"}, "cuda": {"cuda"}, "cuda_rope": folds}.get(choice, set())


def test_skinny_policy_keeps_large_weights_on_cublas():
    """The measured policy: weights above 16 MB leave Triton (the Llama-3.1-8B's qkv, 48 MB, and gate_up), the
    Qwen3-0.6B's qkv (8 MB) takes it at one row; at 4 rows only shapes with out < in (split-K) do."""
    assert skinny_policy(1, 6144, 4096) is False
    assert skinny_policy(1, 28672, 4096) is False
    assert skinny_policy(1, 4096, 1024) is True
    assert skinny_policy(4, 1024, 2048) is True and skinny_policy(4, 4096, 1024) is False


def test_cuda_skinny_policy():
    """KESTREL_CUDA_GEMV: 0 builds nothing; auto (the default) / all take weights above the Triton cap / any
    weight, never on CPU (the kernels need a Hopper GPU); other values are refused."""
    assert cuda_skinny("0") is None
    with pytest.raises(ValueError, match="KESTREL_CUDA_GEMV"):
        cuda_skinny("yes")
    x, w = torch.zeros(1, 4096, dtype=torch.bfloat16), torch.zeros(6144, 4096, dtype=torch.bfloat16)
    assert cuda_skinny("all").use(x, w, True) is False
