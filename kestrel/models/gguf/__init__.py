"""GGUF checkpoints (llama.cpp's single-file format): config, tokenizer and dequantized weights for the engine.

`reader` parses the file once (cached) and maps its metadata onto `ModelConfig`; `tokenizer` builds a
`tokenizers` BPE tokenizer from the embedded vocabulary; `tensors` dequantizes each tensor and renames it to its
HF name (undoing llama.cpp's rotary permutation of q/k); `convert` writes an HF-format directory.
"""
from __future__ import annotations

from pathlib import Path


def is_gguf(path: Path) -> bool:
    """A GGUF checkpoint is one file; by llama.cpp's convention its name ends in .gguf."""
    return path.suffix.lower() == ".gguf"
