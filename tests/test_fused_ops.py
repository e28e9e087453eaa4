"""The torch references in kestrel/kernels/triton/fused_ops.py reproduce HF transformers' Llama ops bit for bit.

These references are the oracle the Triton kernels are held to (tests/test_triton_kernels.py on CPU,
tests/gpu/test_kernels_gpu.py on CUDA), so they must match HF exactly in every dtype, roundings included.
"""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from kestrel.kernels.triton.fused_ops import apply_rotary_ref, rms_norm_ref, silu_and_mul_ref

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_ref_is_hf_llama_rmsnorm(dtype):
    gen = torch.Generator().manual_seed(0)
    hf = LlamaRMSNorm(96, eps=1e-5).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(96, generator=gen))
    x = torch.randn(7, 96, generator=gen).to(dtype)
    with torch.no_grad():
        assert torch.equal(rms_norm_ref(x, hf.weight, 1e-5), hf(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_residual_rms_norm_ref_adds_in_model_dtype_like_hf_decoder_layer(dtype):
    gen = torch.Generator().manual_seed(1)
    hf = LlamaRMSNorm(64, eps=1e-6).to(dtype)
    x = torch.randn(5, 64, generator=gen).to(dtype)
    residual = torch.randn(5, 64, generator=gen).to(dtype)
    out, new_residual = rms_norm_ref(x, hf.weight, 1e-6, residual)
    hf_residual = residual + x          # HF: hidden_states = residual + hidden_states; then the next norm
    with torch.no_grad():
        assert torch.equal(new_residual, hf_residual)
        assert torch.equal(out, hf(hf_residual))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_ref_is_hf_gated_mlp_activation(dtype):
    gen = torch.Generator().manual_seed(2)
    gate = torch.randn(4, 48, generator=gen).to(dtype)
    up = torch.randn(4, 48, generator=gen).to(dtype)
    got, want = silu_and_mul_ref(torch.cat([gate, up], dim=-1)), ACT2FN["silu"](gate) * up
    if dtype == torch.float32:   # torch's strided and contiguous fp32 silu differ in the last bit
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    else:
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_ref_is_hf_apply_rotary_pos_emb(dtype):
    head_dim, num_heads, num_kv_heads = 64, 4, 2
    config = LlamaConfig(hidden_size=head_dim * num_heads, num_attention_heads=num_heads,
                         num_key_value_heads=num_kv_heads, max_position_embeddings=512, rope_theta=10000.0)
    rotary = LlamaRotaryEmbedding(config)
    gen = torch.Generator().manual_seed(3)
    positions = torch.tensor([0, 1, 2, 100, 311, 7])
    q = torch.randn(6, num_heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(6, num_kv_heads, head_dim, generator=gen).to(dtype)
    # our cache: [max_pos, head_dim] = [cos | sin] of position * inv_freq, in fp32
    freqs = torch.outer(torch.arange(512).float(), rotary.inv_freq.float())
    cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)

    cos, sin = rotary(q, positions[None])                     # [1, T, head_dim] in q's dtype
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    got_q, got_k = apply_rotary_ref(q, k, positions, cache)
    assert torch.equal(got_q, hf_q[0].transpose(0, 1))
    assert torch.equal(got_k, hf_k[0].transpose(0, 1))


def test_pdl_is_off_on_cpu_and_under_the_env_switch(monkeypatch):
    """PDL launch options only on a CUDA device of compute capability >= 9 (tests/gpu/test_pdl_gpu.py checks
    that side); on CPU the kernels get USE_PDL=False and no launch_pdl keyword."""
    from kestrel.kernels.triton.pdl import launch_options, pdl_enabled
    from kestrel.envs import switches
    assert launch_options(torch.device("cpu")) == {"USE_PDL": False}
    monkeypatch.setenv("KESTREL_PDL", "0")
    switches.cache_clear()
    assert not pdl_enabled(torch.device("cuda"))   # decided before any CUDA call
