"""Safetensors checkpoint -> each parameter's weight_loader, with progress in bytes and GB/s.

Single-file (`model.safetensors`) and sharded (`model.safetensors.index.json`) checkpoints; HF names are mapped
onto merged parameters through the model's `packed_modules` table. A checkpoint published with PyTorch `.bin`
weights only (`pytorch_model.bin`, sharded with `pytorch_model.bin.index.json`; e.g. the EAGLE-3 drafters of the
EAGLE authors) is read too, through torch.load with weights_only (tensors, never code).
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from kestrel.errors import ModelLoadError
from kestrel.models.weight_placer import WeightPlacer
from kestrel.progress import Progress

logger = logging.getLogger("kestrel.loader")

def checkpoint_files(model_dir: Path) -> list[Path]:
    """The weight files: safetensors (by their index when sharded), else PyTorch .bin ones."""
    for index_name, pattern in (("model.safetensors.index.json", "*.safetensors"),
                                ("pytorch_model.bin.index.json", "pytorch_model*.bin")):
        index = model_dir / index_name
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as exc:
                raise ModelLoadError(f"{index} is not a valid weights index: {exc}") from None
            files = sorted({model_dir / f for f in weight_map.values()})
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise ModelLoadError(f"{index} names shard(s) that are missing: {', '.join(missing)}")
            return files
        files = sorted(model_dir.glob(pattern))
        if files:
            return files
    raise ModelLoadError(f"no *.safetensors files in {model_dir}")


class _Slice:
    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)


class PickledWeights:
    """A PyTorch .bin state dict behind safe_open's interface (keys, get_tensor, get_slice().get_shape()).
    weights_only: the unpickler builds tensors and containers only, never arbitrary objects; mmap: tensors are
    read from the file as they are used, not all at once."""

    def __init__(self, path: Path) -> None:
        try:
            self.tensors = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:   # a legacy (pre-zip) file cannot be memory-mapped
            self.tensors = torch.load(str(path), map_location="cpu", weights_only=True)
        if not isinstance(self.tensors, dict):
            raise ModelLoadError(f"{path} holds a {type(self.tensors).__name__}, not a state dict of tensors")

    def keys(self) -> list[str]:
        return [k for k, v in self.tensors.items() if isinstance(v, torch.Tensor)]

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def get_slice(self, name: str) -> _Slice:
        return _Slice(self.tensors[name])

    def __enter__(self) -> "PickledWeights":
        return self

    def __exit__(self, *exc) -> None:
        self.tensors = {}


def open_weight_file(path: Path):
    """safe_open(path) for safetensors, PickledWeights for a .bin; a file that cannot be read is a ModelLoadError."""
    try:
        if path.suffix == ".bin":
            return PickledWeights(path)
        return safe_open(str(path), framework="pt", device="cpu")
    except ModelLoadError:
        raise
    except Exception as exc:  # safetensors and torch.load raise their own error types for corrupt files
        kind = "a PyTorch state dict" if path.suffix == ".bin" else "safetensors"
        raise ModelLoadError(f"{path}: cannot be read as {kind} ({exc})") from None


def load_safetensors_weights(model: nn.Module, model_dir: Path, progress: Progress | None = None) -> None:
    files = checkpoint_files(model_dir)
    total = sum(f.stat().st_size for f in files)
    placer = WeightPlacer(model)
    done = 0
    start = time.monotonic()
    if progress:
        progress.begin("loading_weights", total, "B")
    files_done = 0
    for path in files:
        with open_weight_file(path) as f:
            for name in f.keys():
                if placer.skips(name):
                    continue
                tensor = f.get_tensor(name)
                placer.place(name, tensor, path.name)
                done += tensor.numel() * tensor.element_size()
                if progress:
                    progress.update(done)
        files_done += path.stat().st_size
        done = files_done   # count headers too, so the phase ends at exactly its total
        if progress:
            progress.update(done)
    placer.check_complete(model_dir)
    seconds = time.monotonic() - start
    logger.info("loaded %.2f GB of weights from %d file(s) in %.1f s (%.2f GB/s)", total / 1e9, len(files),
                seconds, total / 1e9 / max(seconds, 1e-9))
