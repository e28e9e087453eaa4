"""GGUF tensors -> HF-named float tensors: dequantized with gguf.quants, q/k rotary permutation undone."""
from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch import nn

from kestrel.errors import ModelLoadError
from kestrel.models.gguf.reader import architecture, field, open_gguf
from kestrel.models.weight_placer import WeightPlacer
from kestrel.progress import Progress

logger = logging.getLogger("kestrel.gguf")

# Types whose numpy dequantization gguf.quants implements and that llama.cpp writes for dense models. The
# ternary (TQ*), importance-matrix (IQ*) and FP4 types are left out until a checkpoint needs them.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "F64", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")

GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(name: str) -> str:
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    m = BLOCK_RE.fullmatch(name)
    if m is None or m.group(2) not in BLOCK_NAMES:
        raise ModelLoadError(f"GGUF tensor {name!r} has no place in a Llama model")
    return f"model.layers.{m.group(1)}.{BLOCK_NAMES[m.group(2)]}.{m.group(3)}"


def unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's q/k permutation. Its converter reorders each head's rows from HF's rotate-half
    layout (first half, second half) to interleaved pairs (row 2i, 2i+1) for its rotary kernel:
    w.reshape(heads, 2, d/2, ...).swapaxes(1, 2); swapping back restores the halves."""
    rest = w.shape[1:]
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def dequantize(tensor) -> np.ndarray:
    """One gguf ReaderTensor -> float32 array in HF's (rows, cols) order."""
    from gguf import quants

    kind = tensor.tensor_type.name
    if kind not in SUPPORTED_TYPES:
        raise ModelLoadError(f"GGUF tensor {tensor.name!r} has quantization type {kind}, which Kestrel does not "
                             f"dequantize; supported: {', '.join(SUPPORTED_TYPES)}")
    try:
        out = quants.dequantize(tensor.data, tensor.tensor_type)
    except Exception as exc:  # a block count that does not fit the type: corrupt data
        raise ModelLoadError(f"GGUF tensor {tensor.name!r} ({kind}) cannot be dequantized: {exc}") from None
    return np.asarray(out, dtype=np.float32)


def hf_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor, int]]:
    """(HF name, float32 tensor, bytes read from the file) for every tensor of the checkpoint."""
    reader = open_gguf(path)
    arch = architecture(reader)
    heads = int(field(reader, f"{arch}.attention.head_count"))
    kv_heads = int(field(reader, f"{arch}.attention.head_count_kv", heads))
    # Check every type first: an unsupported one fails before minutes of dequantizing the rest.
    for t in reader.tensors:
        if t.tensor_type.name not in SUPPORTED_TYPES:
            dequantize(t)
    for t in reader.tensors:
        name = hf_name(t.name)
        w = dequantize(t)
        expected = tuple(int(n) for n in reversed(t.shape))   # GGUF lists dims fastest-first
        if w.size != int(np.prod(expected)):
            raise ModelLoadError(f"GGUF tensor {t.name!r}: {w.size} values, expected shape {expected}")
        w = w.reshape(expected)
        if ".self_attn.q_proj." in name:
            w = unpermute(w, heads)
        elif ".self_attn.k_proj." in name:
            w = unpermute(w, kv_heads)
        if not w.flags.writeable or not w.flags.c_contiguous:   # F32 tensors are views of the read-only memmap
            w = np.array(w, order="C")
        yield name, torch.from_numpy(w), int(t.n_bytes)


def load_gguf_weights(model: nn.Module, path: Path, progress: Progress | None = None) -> None:
    """load_safetensors_weights for a .gguf file: same name mapping onto merged parameters, same completeness check."""
    reader = open_gguf(path)
    total = sum(int(t.n_bytes) for t in reader.tensors)
    placer = WeightPlacer(model)
    done = 0
    start = time.monotonic()
    if progress:
        progress.begin("loading_weights", total, "B")
    for name, tensor, nbytes in hf_tensors(path):
        if placer.skips(name):
            continue
        placer.place(name, tensor, path.name)
        done += nbytes
        if progress:
            progress.update(done)
    placer.check_complete(path)
    seconds = time.monotonic() - start
    logger.info("loaded and dequantized %.1f MB of GGUF tensors in %.1f s", total / 1e6, seconds)
