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


def scaled(tol: dict, ref: torch.Tensor) -> dict:
    """An assert_close tolerance (atol, rtol) whose absolute part is multiplied by the reference's largest
    magnitude where that exceeds one: the given atol was chosen for values of order one, and a reordered sum's error
    grows with the magnitude of what it sums (logits of ~12 miss an atol picked for ~1)."""
    scale = ref.detach().abs().max().item() if ref.numel() else 0.0
    return dict(tol, atol=tol["atol"] * max(1.0, scale))


def assert_close_scaled(got: torch.Tensor, ref: torch.Tensor, tol: float, what: str = "") -> None:
    """Shapes equal and max |got - ref| <= tol * max(1, max |ref|): `tol` absolute for values of order one,
    relative to the largest magnitude above that."""
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    scale = max(1.0, ref.double().abs().max().item() if ref.numel() else 0.0)
    err = (got.double() - ref.double()).abs().max().item() if ref.numel() else 0.0
    assert err <= tol * scale, f"{what}: max error {err:.2e} > {tol:.0e} x {scale:.3g}"
