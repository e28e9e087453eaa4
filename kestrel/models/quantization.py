"""A checkpoint's `quantization_config` (or `--quantization`) -> the Fp8Scheme its linear layers load, or one
clear error naming a method Kestrel does not load.

Formats read, tensors as the checkpoint names them (W ≈ weight.float() * scale in every case):

    HF "fp8" (DeepSeek-V3, Qwen3-FP8)          {"quant_method": "fp8", "weight_block_size": [128, 128],
                                                "activation_scheme": "dynamic", "modules_to_not_convert": [...]}
        weight F8_E4M3 [out, in], weight_scale_inv F32 [ceil(out/128), ceil(in/128)] (multiplied, despite
        the name); without weight_block_size: weight_scale F32 [] per tensor
    compressed-tensors "float-quantized"       {"quant_method": "compressed-tensors", "config_groups": {g: {
      (llm-compressor)                           "weights": {"num_bits": 8, "type": "float", "strategy":
                                                 "channel" | "tensor" | "block", "block_structure": [bn, bk]},
                                                 "input_activations": {..., "dynamic": true}}}, "ignore": [...]}
        weight F8_E4M3 [out, in], weight_scale F32 [out, 1] (channel), [] or [1] (tensor), tiles (block)
    --quantization fp8 | fp8-per-tensor        a float checkpoint quantized as it loads, one scale per row
                                                (default) or per checkpoint tensor

Activations are quantized per token as they come wherever a kernel wants FP8 inputs; a static `input_scale`
in the checkpoint is not read, nor an FP8 KV cache's `k_scale` / `v_scale` (the KV cache keeps the model dtype):
models/weight_placer.py skips them.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from torch import nn

from kestrel.errors import ModelLoadError
from kestrel.layers.fp8 import Fp8Scheme

logger = logging.getLogger("kestrel.quantization")

QUANTIZATION_FLAGS = ("fp8", "fp8-per-tensor")
SUPPORTED = ("fp8 (HF fine-grained FP8, e.g. DeepSeek-V3, Qwen3-FP8)", "compressed-tensors float-quantized FP8 "
             "(llm-compressor)", "--quantization fp8 | fp8-per-tensor on a float checkpoint")


def _unsupported(what: str, where: Path) -> ModelLoadError:
    return ModelLoadError(f"{where}: quantization {what} is not supported; Kestrel loads: {'; '.join(SUPPORTED)}")


def fp8_scheme(quantization_config: dict[str, Any] | None, flag: str | None, where: Path) -> Fp8Scheme | None:
    """The scheme of a checkpoint (its config.json's quantization_config wins over the flag), the flag's on a
    float checkpoint, or None for a float model."""
    if quantization_config is None:
        if flag is None:
            return None
        if flag not in QUANTIZATION_FLAGS:
            raise ModelLoadError(f"--quantization {flag!r} is not supported: expected one of "
                                 f"{', '.join(QUANTIZATION_FLAGS)}")
        return Fp8Scheme(method=f"--quantization {flag}", online=True, per_tensor=flag == "fp8-per-tensor")
    method = str(quantization_config.get("quant_method", "?")).lower()
    if method == "fp8":
        return _hf_fp8(quantization_config, where)
    if method == "compressed-tensors":
        return _compressed_tensors(quantization_config, where)
    algo = quantization_config.get("quant_algo") or quantization_config.get("format")
    raise _unsupported(repr(method) + (f" ({algo})" if algo else ""), where)


def _hf_fp8(raw: dict[str, Any], where: Path) -> Fp8Scheme:
    fmt = raw.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise _unsupported(f"'fp8' with fmt {fmt!r}", where)
    if raw.get("activation_scheme", "dynamic") != "dynamic":
        logger.warning("%s: activation_scheme %r: the static input scales are not read, activations are quantized "
                       "per token", where, raw.get("activation_scheme"))
    ignore = tuple(raw.get("modules_to_not_convert") or ())
    block = raw.get("weight_block_size")
    if block is None:   # per-tensor FP8 (the older serialized "fp8" checkpoints)
        return Fp8Scheme(method="fp8", scale_name="weight_scale", ignore=ignore)
    if len(block) != 2:
        raise _unsupported(f"'fp8' with weight_block_size {block}", where)
    return Fp8Scheme(method="fp8", block=(int(block[0]), int(block[1])), scale_name="weight_scale_inv",
                     ignore=ignore)


def _compressed_tensors(raw: dict[str, Any], where: Path) -> Fp8Scheme:
    groups = list((raw.get("config_groups") or {}).values())
    if not groups:
        raise _unsupported("'compressed-tensors' without config_groups", where)
    schemes = set()
    for group in groups:
        weights = group.get("weights") or {}
        fmt = group.get("format") or raw.get("format")
        if weights.get("type") != "float" or weights.get("num_bits") != 8 or fmt not in (None, "float-quantized"):
            raise _unsupported(f"'compressed-tensors' {fmt or '?'} ({weights.get('type')}{weights.get('num_bits')}, "
                               f"strategy {weights.get('strategy')})", where)
        strategy = weights.get("strategy")
        if strategy == "block":
            structure = weights.get("block_structure")
            if not structure or len(structure) != 2:
                raise _unsupported(f"'compressed-tensors' block strategy with block_structure {structure}", where)
            schemes.add((int(structure[0]), int(structure[1])))
        elif strategy in ("channel", "tensor"):
            schemes.add(None)
        else:
            raise _unsupported(f"'compressed-tensors' FP8 with weight strategy {strategy!r}", where)
        acts = group.get("input_activations") or {}
        if acts and not acts.get("dynamic", False):
            logger.warning("%s: static activation scales are not read; activations are quantized per token", where)
    if len(schemes) > 1:
        raise _unsupported("'compressed-tensors' with different weight strategies per group", where)
    return Fp8Scheme(method="compressed-tensors", block=schemes.pop(), scale_name="weight_scale",
                     ignore=tuple(raw.get("ignore") or ()))


def checkpoint_modules(model: nn.Module):
    """module name in the model -> the checkpoint modules it holds (HF names; q|k|v: three), through the model's
    `packed_modules` (the reverse of models/weight_placer.py's mapping)."""
    packed: dict[str, tuple[str, object]] = getattr(model, "packed_modules", {})

    def names(module: str) -> list[str]:
        prefix, _, leaf = module.rpartition(".")
        fragments = [f for f, (merged, _) in packed.items() if merged == leaf] or [leaf]
        return [f"model.{prefix}.{f}" if prefix else f"model.{f}" for f in fragments]

    return names
