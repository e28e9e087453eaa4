"""Write an FP8 checkpoint from a float HF directory, in the two formats Kestrel loads (models/quantization.py).

    hf                  quantization_config {"quant_method": "fp8", "weight_block_size": [bn, bk], ...}:
                        <module>.weight F8_E4M3 [out, in], <module>.weight_scale_inv F32 [ceil(out/bn), ceil(in/bk)]
                        (strategy "block"); strategy "tensor" writes the older per-tensor form (no
                        weight_block_size, <module>.weight_scale F32 [])
    compressed-tensors  {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": ...}:
                        <module>.weight F8_E4M3, <module>.weight_scale F32 [out, 1] (channel), [1] (tensor) or
                        tiles (block); activations dynamic per token

The decoder layers' projections (`model.layers.*_proj`, MoE experts included: Qwen3-MoE's experts.{e}.*_proj,
Mixtral's experts.{e}.w1/w2/w3) are quantized, except the modules in `ignore`; every
other tensor (embeddings, norms, lm_head) is copied as it is. Each input file becomes an output file of the same
name (a sharded checkpoint's index is rewritten with the scales). The tokenizer and generation files are copied;
the source's model card (README.md) is not: a short card says what was quantized, from what, and how. Used by tests
and the GPU suite; `kestrel quantize` runs it.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kestrel.errors import KestrelError
from kestrel.kernels.fp8_quant import quantize_per_block, quantize_per_row, quantize_per_tensor
from kestrel.models.loader import checkpoint_files
from kestrel.models.names import MODELS

FORMATS = ("hf", "compressed-tensors")
STRATEGIES = {"hf": ("block", "tensor"), "compressed-tensors": ("channel", "tensor", "block")}


def check_source(src: Path) -> None:
    """A float HF checkpoint directory (config.json and *.safetensors), or a KestrelError that says what `src` is
    instead: missing, a GGUF file, a short model name (those are GGUF files), a directory without a checkpoint."""
    convert = f"convert it to an HF directory first: kestrel convert {src} DIR"
    if src.suffix.lower() == ".gguf" or (str(src).lower() in MODELS and not src.exists()):
        what = "a GGUF file" if src.suffix.lower() == ".gguf" else "a short name for a GGUF model"
        raise KestrelError(f"{src} is {what}; kestrel quantize reads a float HF safetensors directory: {convert}")
    if not src.exists():
        raise KestrelError(f"{src} does not exist: kestrel quantize reads a float HF safetensors directory")
    if not src.is_dir():
        raise KestrelError(f"{src} is not a directory: kestrel quantize reads a float HF safetensors directory")
    if not (src / "config.json").is_file():
        raise KestrelError(f"{src} has no config.json: kestrel quantize reads a float HF safetensors directory")
    if not (src / "model.safetensors.index.json").is_file() and not any(src.glob("*.safetensors")):
        raise KestrelError(f"{src} has no *.safetensors files: kestrel quantize reads a float HF safetensors "
                           "directory")


def model_card(src: Path, fmt: str, strategy: str, block: tuple[int, int], ignore: tuple[str, ...]) -> str:
    """The README.md of a written checkpoint: what it is an FP8 quantization of, and how."""
    how = {"block": f"one scale per {block[0]}x{block[1]} tile", "channel": "one scale per output channel",
           "tensor": "one scale per tensor"}[strategy]
    fmt_name = "HF fp8 (quant_method fp8)" if fmt == "hf" else "compressed-tensors (float-quantized)"
    kept = f" {', '.join(ignore)} left float too." if ignore else ""
    return (f"# FP8 quantization of {src.name}\n\n"
            f"This checkpoint is an FP8 (E4M3) quantization of `{src}`, written by `kestrel quantize` in the "
            f"{fmt_name} format: the decoder layers' linear weights in FP8 with float32 scales ({how}), "
            f"activations quantized dynamically per token; embeddings, norms and lm_head are as in the source."
            f"{kept}\n\nIt is not the source model: its outputs differ slightly. See the source model's own card "
            "for its license, training and intended use.\n")


# Mixtral's experts are named w1 / w3 / w2 (gate / up / down), not *_proj; the router (mlp.gate,
# block_sparse_moe.gate) is neither and stays float, as Qwen3-MoE-FP8 keeps it
_MIXTRAL_EXPERT = re.compile(r".*\.experts\.\d+\.w[123]\.weight$")


def _quantized(name: str, tensor: torch.Tensor, ignore: tuple[str, ...], strategy: str = "block") -> bool:
    """The decoder's projections and, with block scales, every MoE expert's (the fused MoE kernel reads tile
    scales; per-row / per-tensor experts stay float), unless `ignore` names the module, a dotted suffix of it, or
    a module it is in (model.layers.0.mlp.experts: that block's experts)."""
    module = name.removesuffix(".weight")
    if strategy != "block" and re.search(r"\.experts\.\d+\.", name):
        return False
    return (name.startswith("model.layers.") and (name.endswith("_proj.weight") or _MIXTRAL_EXPERT.match(name))
            and tensor.dim() == 2
            and not any(module == m or module.endswith("." + m) or module.startswith(m + ".") for m in ignore))


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
    check_source(src)
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
                if _quantized(name, tensor, ignore, strategy):
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
    for extra in src.iterdir():   # tokenizer, generation config, chat template (not the model card)
        if extra.is_file() and extra.suffix != ".safetensors" and extra.name not in (
                "config.json", "model.safetensors.index.json", "README.md"):
            shutil.copy2(extra, dst / extra.name)
    (dst / "README.md").write_text(model_card(src, fmt, strategy, block, ignore))
    return dst
