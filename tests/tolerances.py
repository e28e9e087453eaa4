"""Float comparisons with bounds that scale with the values compared.

A float32 sum split another way (over two ranks, in another kernel's order, on another CPU's vector width) is not
bit-identical, and its error grows with the magnitude of what is summed: a bare absolute bound passes on one machine
and fails on the next. These bounds are relative to the reference's largest magnitude (an elementwise relative
bound would blow up at values near zero, which logits and activations cross)."""
from __future__ import annotations

import torch


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / max |ref|, in float64 (0 when both are all zero)."""
    got, ref = got.double(), ref.double()
    scale = ref.abs().max().item() if ref.numel() else 0.0
    err = (got - ref).abs().max().item() if ref.numel() else 0.0
    if scale == 0.0:
        return 0.0 if err == 0.0 else float("inf")
    return err / scale


def assert_close_relative(got: torch.Tensor, ref: torch.Tensor, rtol: float, what: str = "") -> None:
    """Shapes equal and max |got - ref| <= rtol * max |ref|."""
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    rel = relative_error(got, ref)
    assert rel <= rtol, f"{what}: relative error {rel:.2e} > {rtol:.0e}"
