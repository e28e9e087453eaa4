"""An FP8 KV cache's per-tensor scales (kernels/kv_store.py) from a checkpoint, under the names vLLM reads.

    layers.{i}.self_attn.k_scale / v_scale                   FP8 checkpoints (vLLM's own, AutoFP8), Quark
    layers.{i}.self_attn.attn.k_scale / v_scale              vLLM's module path
    layers.{i}.self_attn.k_proj.k_scale / v_proj.v_scale     NVIDIA ModelOpt
    layers.{i}.self_attn.k_proj.output_scale / v_proj.ditto  compressed-tensors (llm-compressor)
    layers.{i}.self_attn.kv_scale                            the old single scale: K's and V's

Each is a dequantization scale: the cache holds x / scale. A layer (or a whole checkpoint) without them keeps 1.0,
which suits activations inside e4m3's +-448 (startup logs that it defaults). MLA layers read k_scale for their
latent cache, as vLLM does. A scale of several elements (per head) is reduced to its largest, which is the safe
per-tensor choice: no value is clipped that the per-head scales kept.
"""
from __future__ import annotations

import logging
import math
import re
from pathlib import Path

from torch import nn

from kestrel.errors import ModelLoadError
from kestrel.models.loader import checkpoint_files, open_weight_file
from kestrel.models.weight_placer import KV_SCALE_NAMES

logger = logging.getLogger("kestrel.loader")

_LAYER_SCALE = re.compile(r"^(?:model\.)?layers\.(\d+)\.self_attn\.(.+)$")

KVScales = dict[int, dict[str, float]]   # layer -> {"k": scale, "v": scale}


def scale_target(name: str) -> tuple[int, tuple[str, ...]] | None:
    """(layer, which scales) for a checkpoint tensor name that is a KV scale, else None."""
    match = _LAYER_SCALE.match(name)
    if match is None or match.group(2) not in KV_SCALE_NAMES:
        return None
    return int(match.group(1)), KV_SCALE_NAMES[match.group(2)]


def read_kv_scales(model_dir: Path) -> KVScales:
    """Every KV scale of a safetensors (or .bin) checkpoint directory; {} for a GGUF file or none found."""
    if not model_dir.is_dir():
        return {}
    scales: KVScales = {}
    for path in checkpoint_files(model_dir):
        with open_weight_file(path) as f:
            for name in f.keys():
                target = scale_target(name)
                if target is None:
                    continue
                value = float(f.get_tensor(name).float().abs().max())
                if not math.isfinite(value) or value <= 0:
                    raise ModelLoadError(f"{path.name}: KV cache scale {name!r} is {value}; expected a finite "
                                         "scale > 0")
                layer, which = target
                for kind in which:
                    scales.setdefault(layer, {})[kind] = value
    return scales


def apply_kv_scales(layers: nn.ModuleList, scales: KVScales) -> None:
    """Set each layer's self_attn.k_scale / v_scale (plain floats; the attention reads them every step)."""
    for index, found in scales.items():
        if index >= len(layers):
            raise ModelLoadError(f"the checkpoint has KV cache scales for layer {index}, but the model has "
                                 f"{len(layers)} layers")
        attn = layers[index].self_attn
        for kind, value in found.items():
            setattr(attn, f"{kind}_scale", value)


def load_kv_scales(model: nn.Module, model_dir: Path) -> int:
    """Read and apply the checkpoint's scales, logging where they come from; returns how many layers had any."""
    scales = read_kv_scales(model_dir)
    apply_kv_scales(model.layers, scales)
    layers = len(model.layers)
    if not scales:
        logger.warning("FP8 KV cache: the checkpoint has no k_scale/v_scale, so the scales default to 1.0 (fine "
                       "for K/V inside e4m3's +-448; docs/server.md gives the measured accuracy)")
    elif len(scales) < layers:
        logger.warning("FP8 KV cache: k_scale/v_scale for %d of %d layers from the checkpoint; the others default "
                       "to 1.0", len(scales), layers)
    else:
        logger.info("FP8 KV cache: per-tensor k_scale/v_scale of all %d layers from the checkpoint", layers)
    return len(scales)
