"""Write an FP8 checkpoint from a float HF directory, in the two formats Kestrel loads (models/quantization.py).

    hf                  quantization_config {"quant_method": "fp8", "weight_block_size": [bn, bk], ...}:
                        <module>.weight F8_E4M3 [out, in], <module>.weight_scale_inv F32 [ceil(out/bn), ceil(in/bk)]
                        (strategy "block"); strategy "tensor" writes the older per-tensor form (no
                        weight_block_size, <module>.weight_scale F32 [])
    compressed-tensors  {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": ...}:
                        <module>.weight F8_E4M3, <module>.weight_scale F32 [out, 1] (channel), [1] (tensor) or
                        tiles (block); activations dynamic per token

The decoder layers' projections (`model.layers.*_proj`) are quantized, except the modules in `ignore`; every
other tensor (embeddings, norms, lm_head) is copied as it is. Each input file becomes an output file of the same
name (a sharded checkpoint's index is rewritten with the scales). Used by tests and the GPU suite; `kestrel
quantize` runs it.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kestrel.errors import KestrelError
from kestrel.kernels.fp8_quant import quantize_per_block, quantize_per_row, quantize_per_tensor
from kestrel.models.loader import checkpoint_files

FORMATS = ("hf", "compressed-tensors")
STRATEGIES = {"hf": ("block", "tensor"), "compressed-tensors": ("channel", "tensor", "block")}


def _quantized(name: str, tensor: torch.Tensor, ignore: tuple[str, ...]) -> bool:
    module = name.removesuffix(".weight")
    return (name.startswith("model.layers.") and name.endswith("_proj.weight") and tensor.dim() == 2
            and not any(module == m or module.endswith("." + m) for m in ignore))


def quantization_config(fmt: str, strategy: str, block: tuple[int, int], ignore: tuple[str, ...]) -> dict:
    """The config.json entry of a checkpoint written in `fmt` with `strategy`."""
    if fmt == "hf":
        cfg = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3"}
        if strategy == "block":
            cfg["weight_block_size"] = list(block)
        if ignore:
            cfg["modules_to_not_convert"] = list(ignore)
        return cfg
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": strategy,
               "block_structure": list(block) if strategy == "block" else None}
    acts = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True, "strategy": "token"}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}},
            "ignore": ["lm_head", *ignore]}


def _quantize(fmt: str, strategy: str, block: tuple[int, int], w: torch.Tensor
              ) -> tuple[torch.Tensor, str, torch.Tensor]:
    """(w8, the scale's tensor-name suffix, scale) in the format's names and shapes."""
    if strategy == "block":
        w8, scale = quantize_per_block(w, block)
        return w8, "weight_scale_inv" if fmt == "hf" else "weight_scale", scale
    if strategy == "tensor":
        w8, scale = quantize_per_tensor(w)
        return w8, "weight_scale", scale if fmt == "hf" else scale.reshape(1)
    w8, scale = quantize_per_row(w)
    return w8, "weight_scale", scale


def write_fp8_checkpoint(src: Path, dst: Path, fmt: str = "hf", strategy: str | None = None,
                         block: tuple[int, int] = (128, 128), ignore: tuple[str, ...] = (),
                         device: str = "cpu") -> Path:
    """`src` (a float HF directory) quantized into `dst` (new or empty); returns dst. `strategy` defaults to block
    for hf, channel for compressed-tensors; `ignore`: checkpoint module names (model.layers.0.mlp.down_proj)
    left float; `device`: where the scales are computed (an 8B checkpoint: ~1 min on a few CPU cores, seconds on
    a GPU)."""
    src, dst = Path(src), Path(dst)
    if fmt not in FORMATS:
        raise KestrelError(f"FP8 format {fmt!r} is not one Kestrel writes: expected {', '.join(FORMATS)}")
    strategy = strategy or ("block" if fmt == "hf" else "channel")
    if strategy not in STRATEGIES[fmt]:
        raise KestrelError(f"FP8 format {fmt} has no strategy {strategy!r}: expected "
                           f"{', '.join(STRATEGIES[fmt])}")
    config = json.loads((src / "config.json").read_text())
    if config.get("quantization_config"):
        raise KestrelError(f"{src} is already quantized ({config['quantization_config'].get('quant_method')})")
    if dst.exists() and any(dst.iterdir()):
        raise KestrelError(f"{dst} is not empty")
    dst.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for path in checkpoint_files(src):
        out: dict[str, torch.Tensor] = {}
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                if _quantized(name, tensor, ignore):
                    w8, scale_name, scale = _quantize(fmt, strategy, block, tensor.to(device))
                    out[name] = w8.contiguous().cpu()
                    out[f"{name.removesuffix('weight')}{scale_name}"] = scale.float().contiguous().cpu()
                else:
                    out[name] = tensor.contiguous()
        save_file(out, str(dst / path.name), metadata={"format": "pt"})
        weight_map.update({name: path.name for name in out})
    if (src / "model.safetensors.index.json").is_file():
        total = sum((dst / f).stat().st_size for f in set(weight_map.values()))
        (dst / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    config["quantization_config"] = quantization_config(fmt, strategy, block, ignore)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for extra in src.iterdir():   # tokenizer, generation config, chat template, model card
        if extra.is_file() and extra.suffix != ".safetensors" and extra.name not in (
                "config.json", "model.safetensors.index.json"):
            shutil.copy2(extra, dst / extra.name)
    return dst
