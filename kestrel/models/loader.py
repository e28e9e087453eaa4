"""Safetensors checkpoint -> each parameter's weight_loader, with progress in bytes and GB/s.

Single-file (`model.safetensors`) and sharded (`model.safetensors.index.json`) checkpoints; HF names are mapped
onto merged parameters through the model's `packed_modules` table.
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from safetensors import safe_open
from torch import nn

from kestrel.errors import ModelLoadError
from kestrel.models.weight_placer import WeightPlacer
from kestrel.progress import Progress

logger = logging.getLogger("kestrel.loader")

def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise ModelLoadError(f"{index} is not a valid safetensors index: {exc}") from None
        files = sorted({model_dir / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index} names shard(s) that are missing: {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors files in {model_dir}")
    return files


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
        try:
            handle = safe_open(str(path), framework="pt", device="cpu")
        except Exception as exc:  # safetensors raises its own error types for corrupt headers
            raise ModelLoadError(f"{path}: cannot be read as safetensors ({exc})") from None
        with handle as f:
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
