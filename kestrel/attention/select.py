"""Pick an attention backend by name: "torch" (reference, any device), "triton", "flashinfer" (CUDA only)."""
from __future__ import annotations

import importlib

import torch

from kestrel.attention.base import AttentionBackend
from kestrel.errors import KestrelError

BACKEND_NAMES = ("torch", "triton", "flashinfer")


def available_backends(device: torch.device | str | None = None) -> list[str]:
    """Backends that can run on `device` (default: CUDA when present) in this environment."""
    device = _resolve_device(device)
    names = ["torch"]
    if device.type == "cuda":
        if _importable("triton"):
            names.append("triton")
        if _importable("flashinfer"):
            names.append("flashinfer")
    return names


def select_backend(name: str | None, device: torch.device | str) -> AttentionBackend:
    """name None: triton on CUDA when triton imports, else torch. flashinfer is only used when asked for."""
    device = _resolve_device(device)
    if name is None:
        name = "triton" if device.type == "cuda" and _importable("triton") else "torch"
    if name not in BACKEND_NAMES:
        raise KestrelError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")
    if name == "torch":
        from kestrel.attention.torch_ref import TorchAttentionBackend
        return TorchAttentionBackend()
    if device.type != "cuda":
        raise KestrelError(f"attention backend {name!r} needs a CUDA device, got {str(device)!r}; "
                           f"use 'torch' on {device.type}")
    if name == "triton":
        if not _importable("triton"):
            raise KestrelError("attention backend 'triton' needs the 'triton' package (pip install triton)")
        from kestrel.attention.triton_backend import TritonAttentionBackend
        return TritonAttentionBackend()
    from kestrel.attention.flashinfer_backend import FlashInferAttentionBackend
    return FlashInferAttentionBackend()


def _resolve_device(device: torch.device | str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _importable(module: str) -> bool:
    # Installed is not enough: a wheel built for another CUDA or torch fails at import time.
    try:
        importlib.import_module(module)
    except Exception:  # noqa: BLE001 - any import failure means "not usable here"
        return False
    return True
