"""A checkpoint by its format: an HF directory (config.json + safetensors) or one GGUF file."""
from __future__ import annotations

from pathlib import Path

from torch import nn

from kestrel.models.gguf.reader import gguf_model_config
from kestrel.models.gguf.tensors import load_gguf_weights
from kestrel.models.loader import load_safetensors_weights
from kestrel.models.model_config import ModelConfig, hf_model_config
from kestrel.progress import Progress


def is_gguf(path: Path) -> bool:
    return path.suffix.lower() == ".gguf"


def load_model_config(path: Path) -> ModelConfig:
    """config.json of an HF directory, or the metadata inside a GGUF file."""
    return gguf_model_config(path) if is_gguf(path) else hf_model_config(path)


def load_weights(model: nn.Module, path: Path, progress: Progress | None = None) -> None:
    """Every parameter of `model` from the checkpoint, through its weight_loader (GGUF: dequantized)."""
    if is_gguf(path):
        load_gguf_weights(model, path, progress)
    else:
        load_safetensors_weights(model, path, progress)
