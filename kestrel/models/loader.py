"""Safetensors checkpoint -> each parameter's weight_loader, with progress in bytes and GB/s.

Single-file (`model.safetensors`) and sharded (`model.safetensors.index.json`) checkpoints; HF names are mapped
onto merged parameters through the model's `packed_modules` table.
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
from kestrel.progress import Progress

logger = logging.getLogger("kestrel.loader")

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


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


def _target(name: str, packed: dict[str, tuple[str, object]]) -> tuple[str, object | None]:
    """HF tensor name -> (our parameter name, shard id or None)."""
    if name.startswith("model."):
        name = name[len("model."):]
    for fragment, (merged, shard_id) in packed.items():
        if f".{fragment}." in name:
            return name.replace(f".{fragment}.", f".{merged}."), shard_id
    return name, None


class WeightPlacer:
    """Puts checkpoint tensors, by HF name, into a model's parameters through their weight_loaders (onto merged
    parameters through the model's `packed_modules`), and checks at the end that none was left out."""

    def __init__(self, model: nn.Module) -> None:
        self.model_name = type(model).__name__
        self.params = dict(model.named_parameters(remove_duplicate=False))
        self.packed = getattr(model, "packed_modules", {})
        self.tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
        self.loaded: set[str] = set()

    def skips(self, name: str) -> bool:
        return name.endswith(IGNORED_SUFFIXES) or (self.tied and name == "lm_head.weight")

    def place(self, name: str, tensor: torch.Tensor, source: str) -> None:
        target, shard_id = _target(name, self.packed)
        param = self.params.get(target)
        if param is None:
            raise ModelLoadError(f"{source}: tensor {name!r} has no place in {self.model_name} (unexpected weight)")
        loader = getattr(param, "weight_loader")
        tensor = tensor.to(param.dtype)
        if shard_id is None:
            loader(param, tensor, name)
        else:
            loader(param, tensor, name, shard_id)
        self.loaded.add(target if shard_id is None else f"{target}:{shard_id}")

    def check_complete(self, checkpoint: Path) -> None:
        _check_complete(self.params, self.packed, self.loaded, self.tied, checkpoint)


def load_weights(model: nn.Module, model_dir: Path, progress: Progress | None = None) -> None:
    if model_dir.suffix.lower() == ".gguf":   # one quantized file: dequantized tensor by tensor
        from kestrel.models.gguf.tensors import load_gguf_weights
        return load_gguf_weights(model, model_dir, progress)
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


def _check_complete(params: dict[str, nn.Parameter], packed, loaded: set[str], tied: bool,
                    model_dir: Path) -> None:
    shards_of: dict[str, list[object]] = {}
    for _, (merged, shard_id) in packed.items():
        shards_of.setdefault(merged, []).append(shard_id)
    missing = []
    for name in params:
        if tied and name == "lm_head.weight":
            continue
        merged = next((m for m in shards_of if f".{m}." in name), None)
        if merged is None:
            if name not in loaded:
                missing.append(name)
        else:
            if name.endswith(".bias") and not any(f"{name}:{s}" in loaded for s in shards_of[merged]):
                missing.append(name)
                continue
            missing += [f"{name} ({s})" for s in shards_of[merged] if f"{name}:{s}" not in loaded]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ModelLoadError(f"checkpoint in {model_dir} lacks tensor(s): {shown}")
