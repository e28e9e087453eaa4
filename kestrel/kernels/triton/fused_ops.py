"""Fused elementwise ops for the GPU path: Triton kernels beside their torch references (`*_ref`).

The references reproduce HF transformers' Llama arithmetic step by step, including where it rounds to the model
dtype, so the kernels can be held to them closely:
  - RMSNorm computes in fp32 and casts back before the weight: weight * x_normed.to(input_dtype)
  - the residual stream is added in the model dtype (residual + hidden_states)
  - SiLU-and-mul rounds silu(gate) to the model dtype before multiplying by up
  - rotary ("rotate_half", NeoX style) casts cos/sin to the model dtype and rounds each product
The decode-path kernels (RMSNorm, SiLU-and-mul) launch with PDL on Hopper (kestrel/kernels/triton/pdl.py). Kernels need
CUDA tensors, or Triton's interpreter (TRITON_INTERPRET=1 before triton is imported) for CPU ones.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.kernels.triton.pdl import launch_options, pdl_wait

# Launch keywords for kernels that must round as HF does: each 16-bit product rounded before the sum
# (x * cos + rotate_half(x) * sin). By default Triton contracts a multiply and the add after it into one
# fma.rn.bf16, which rounds once: the attention prologue's q then differed from HF's in 16-19% of its elements by an
# ulp (H200). With contraction off the PTX holds mul.rn.bf16 then add/sub.rn.bf16
# (tests/test_sm90_builds.py).
HF_ROUNDING = {"enable_fp_fusion": False}

# ---------------------------------------------------------------------------------------------------------------
# RMSNorm, optionally fused with the residual add
# ---------------------------------------------------------------------------------------------------------------


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim; with residual: (rms_norm(x + residual), x + residual)."""
    if residual is not None:
        x = x + residual
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    out = weight * normed.to(x.dtype)
    return out if residual is None else (out, x)


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    stride_x, stride_r, stride_o, stride_ro,
    eps,
    N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, USE_PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)   # a weight: readable before the wait
    pdl_wait(USE_PDL)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    in_dtype = x.dtype
    if HAS_RESIDUAL:
        # The residual stream lives in the model dtype: round the sum before normalising it.
        x = (x.to(tl.float32) + tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
             ).to(in_dtype)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 0) / N + eps)
    normed = (xf * rstd).to(in_dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of rms_norm_ref; x [..., N] (e.g. [T, hidden] or [T, heads, head_dim] for QK-norm)."""
    hidden = x.shape[-1]
    assert weight.shape == (hidden,), f"weight {tuple(weight.shape)} does not match last dim {hidden}"
    rows = x.reshape(-1, hidden)
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    out = torch.empty(rows.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if residual is not None:
        assert residual.shape == x.shape, f"residual {tuple(residual.shape)} != x {tuple(x.shape)}"
        res = residual.reshape(-1, hidden)
        res = res if res.stride(-1) == 1 else res.contiguous()
        res_out = torch.empty(rows.shape, dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
    else:
        res, res_out = rows, out   # unused by the kernel (HAS_RESIDUAL=False)
    if rows.shape[0] > 0:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(rows.shape[0],)](
            rows, res, weight, out, res_out,
            rows.stride(0), res.stride(0), out.stride(0), res_out.stride(0),
            eps,
            N=hidden, BLOCK=block, HAS_RESIDUAL=residual is not None,
            num_warps=min(max(block // 256, 1), 16), **launch_options(x.device),
        )
    out = out.view(x.shape)
    return out if residual is None else (out, res_out.view(x.shape))


# ---------------------------------------------------------------------------------------------------------------
# SiLU and mul (the gated MLP's activation over the fused gate_up projection)
# ---------------------------------------------------------------------------------------------------------------


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] = [gate | up] -> silu(gate) * up [..., I]."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, I: tl.constexpr, BLOCK: tl.constexpr,
                         USE_PDL: tl.constexpr):
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + I + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g * tl.sigmoid(g)).to(gate.dtype).to(tl.float32)   # F.silu rounds to the model dtype
    tl.store(out_ptr + row * stride_o + cols, (act * up.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Triton twin of silu_and_mul_ref."""
    width = x.shape[-1]
    assert width % 2 == 0, f"last dim {width} is not [gate | up]"
    inter = width // 2
    rows = x.reshape(-1, width)
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    out = torch.empty(rows.shape[0], inter, dtype=x.dtype, device=x.device)
    if rows.shape[0] > 0:
        block = min(triton.next_power_of_2(inter), 1024)
        _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(inter, block))](
            rows, out, rows.stride(0), out.stride(0), I=inter, BLOCK=block, num_warps=4,
            **launch_options(x.device))
    return out.view(*x.shape[:-1], inter)


# ---------------------------------------------------------------------------------------------------------------
# Rotary position embedding, NeoX / Llama "rotate_half" style
# ---------------------------------------------------------------------------------------------------------------
#
# cos_sin_cache: [max_position, rot_dim] = [cos(p * inv_freq) | sin(p * inv_freq)], each half rot_dim / 2 wide.
# Within each head the first rot_dim dims rotate as pairs (i, i + rot_dim / 2); dims past rot_dim pass through.


def apply_rotary_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hkv, D], positions [T] -> rotated (q, k), new tensors."""
    cos, sin = cos_sin_cache[positions.long()].chunk(2, dim=-1)   # [T, rot_dim / 2] each

    def rotate(x: torch.Tensor) -> torch.Tensor:
        rot_dim = cos_sin_cache.shape[-1]
        c = torch.cat([cos, cos], dim=-1).to(x.dtype)[:, None, :]
        s = torch.cat([sin, sin], dim=-1).to(x.dtype)[:, None, :]
        x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
        x1, x2 = x_rot.chunk(2, dim=-1)
        rotated = x_rot * c + torch.cat([-x2, x1], dim=-1) * s
        return torch.cat([rotated, x_pass], dim=-1)

    return rotate(q), rotate(k)


@triton.jit
def _rotate_heads(x_ptr, stride_h, num_heads, cos, sin,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_HALF)
    mask = (heads[:, None] < num_heads) & (cols[None, :] < HALF)
    first = x_ptr + heads[:, None] * stride_h + cols[None, :]
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    c = cos[None, :].to(dtype).to(tl.float32)
    s = sin[None, :].to(dtype).to(tl.float32)
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    # Round each product to the model dtype as HF does (x * cos) + (rotate_half(x) * sin).
    out1 = (x1f * c).to(dtype).to(tl.float32) - (x2f * s).to(dtype).to(tl.float32)
    out2 = (x2f * c).to(dtype).to(tl.float32) + (x1f * s).to(dtype).to(tl.float32)
    tl.store(first, out1.to(dtype), mask=mask)
    tl.store(first + HALF, out2.to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, positions_ptr, cache_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cache,
    num_q_heads, num_k_heads,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)
    cos = tl.load(cache_ptr + pos * stride_cache + cols, mask=cols < HALF, other=0.0)
    sin = tl.load(cache_ptr + pos * stride_cache + HALF + cols, mask=cols < HALF, other=0.0)
    _rotate_heads(q_ptr + token * stride_qt, stride_qh, num_q_heads, cos, sin, HALF, BLOCK_HQ, BLOCK_HALF)
    _rotate_heads(k_ptr + token * stride_kt, stride_kh, num_k_heads, cos, sin, HALF, BLOCK_HK, BLOCK_HALF)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of apply_rotary_ref that rotates q [T, Hq, D] and k [T, Hkv, D] in place; returns (q, k).

    q and k may be strided views (e.g. slices of a fused qkv output) as long as head_dim is contiguous.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    rot_dim = cos_sin_cache.shape[-1]
    assert rot_dim % 2 == 0 and rot_dim <= head_dim, f"rot_dim {rot_dim} must be even and <= head_dim {head_dim}"
    assert q.stride(-1) == 1 and k.stride(-1) == 1, "rotary runs in place: head_dim must be contiguous"
    assert cos_sin_cache.stride(-1) == 1
    if num_tokens == 0:
        return q, k
    half = rot_dim // 2
    _rotary_kernel[(num_tokens,)](
        q, k, positions, cos_sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        num_q_heads, k.shape[1],
        HALF=half, BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_HQ=triton.next_power_of_2(num_q_heads), BLOCK_HK=triton.next_power_of_2(k.shape[1]),
        num_warps=4, **HF_ROUNDING,
    )
    return q, k
