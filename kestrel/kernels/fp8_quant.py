"""FP8 (E4M3) quantization arithmetic, in plain torch: the oracle of the FP8 kernels and the checkpoint writer's.

One convention everywhere, the checkpoints' own: the scale is MULTIPLIED, W ≈ w8.float() * scale, with scale
expanded to W's shape:

    per tensor   scale []                                   w8 = round(W / (amax(W) / 448))
    per row      scale [out, 1]                             one amax per output row
    per block    scale [ceil(out / bn), ceil(in / bk)]      one amax per bn x bk tile (the last tiles may be short)
"""
from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max   # 448
_TINY = 1e-12                    # an all-zero row / tile gets a scale that still divides


def _cast(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(w8, scale []) with one scale for the whole tensor."""
    w = w.float()
    scale = (w.abs().amax().clamp(min=_TINY) / FP8_MAX).reshape(())
    return _cast(w, scale), scale


def quantize_per_row(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(w8, scale [out, 1]) with one scale per output row (per channel)."""
    w = w.float()
    scale = w.abs().amax(dim=1, keepdim=True).clamp(min=_TINY) / FP8_MAX
    return _cast(w, scale), scale


def expand_block_scales(scale: torch.Tensor, block: tuple[int, int], shape: torch.Size | tuple[int, int]
                        ) -> torch.Tensor:
    """[ceil(out / bn), ceil(in / bk)] tile scales -> [out, in], each tile's scale over its elements."""
    bn, bk = block
    return scale.repeat_interleave(bn, dim=0)[:shape[0]].repeat_interleave(bk, dim=1)[:, :shape[1]]


def quantize_per_block(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(w8, scale [ceil(out / bn), ceil(in / bk)]) with one scale per bn x bk tile."""
    w = w.float()
    bn, bk = block
    out, inp = w.shape
    rows, cols = -(-out // bn), -(-inp // bk)
    padded = torch.zeros(rows * bn, cols * bk, dtype=torch.float32, device=w.device)
    padded[:out, :inp] = w.abs()
    amax = padded.reshape(rows, bn, cols, bk).amax(dim=(1, 3))
    scale = amax.clamp(min=_TINY) / FP8_MAX
    return _cast(w, expand_block_scales(scale, block, w.shape)), scale


def dequantize(w8: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None) -> torch.Tensor:
    """w8.float() * scale in float32 [out, in]: per tensor, per row, or per tile (with `block`)."""
    if block is not None:
        scale = expand_block_scales(scale, block, w8.shape)
    return w8.float() * scale.float()


def quantize_activations_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token activation quantization: (x8 [M, K], scale [M, 1] float32), x ≈ x8 * scale."""
    return quantize_per_row(x)


def quantize_activation_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token, per-group activation quantization (DeepSeek-V3's 1 x 128): (x8 [M, K], scale
    [M, ceil(K / group)] float32), x ≈ x8 * scale over each row's `group`-column runs (the last may be short)."""
    return quantize_per_block(x, (1, group))


def fp8_w8a8_ref(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """The W8A8 block matmul's oracle, in float32: x quantized per row in groups of the tile width, multiplied by
    the FP8 weight, each (row group x tile) product scaled by both scales; one rounding to x's dtype."""
    x8, x_scale = quantize_activation_groups(x, block[1])
    out = dequantize(x8, x_scale, (1, block[1])) @ dequantize(w8, scale, block).T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
