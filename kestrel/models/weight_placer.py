"""WeightPlacer: checkpoint tensors, by HF name, into a model's parameters (shared by every checkpoint format)."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from kestrel.errors import ModelLoadError

# input_scale: a static FP8 activation scale; Kestrel quantizes activations per token as they come (layers/fp8.py).
# An FP8 KV cache's per-tensor scales, by their name after "layers.{i}.self_attn." -> the scales it sets (the
# formats are listed in models/kv_scales.py, which reads them; the placer leaves them alone).
KV_SCALE_NAMES: dict[str, tuple[str, ...]] = {
    "k_scale": ("k",), "v_scale": ("v",),
    "attn.k_scale": ("k",), "attn.v_scale": ("v",),
    "k_proj.k_scale": ("k",), "v_proj.v_scale": ("v",),
    "k_proj.output_scale": ("k",), "v_proj.output_scale": ("v",),
    "kv_scale": ("k", "v"),
}
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", ".input_scale", ".k_scale", ".v_scale") + \
    tuple(f".self_attn.{name}" for name in KV_SCALE_NAMES)


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
        # a model's own tensors to leave unread (DeepSeek-V3's multi-token-prediction layer): name -> bool
        self.model_skips = getattr(model, "skips_weight", None)
        self.loaded: set[str] = set()

    def skips(self, name: str) -> bool:
        return name.endswith(IGNORED_SUFFIXES) or (self.tied and name == "lm_head.weight") or \
            (self.model_skips is not None and self.model_skips(name))

    def place(self, name: str, tensor: torch.Tensor, source: str) -> None:
        target, shard_id = _target(name, self.packed)
        param = self.params.get(target)
        if param is None:
            raise ModelLoadError(f"{source}: tensor {name!r} has no place in {self.model_name} (unexpected weight)")
        loader = getattr(param, "weight_loader")
        if not getattr(param, "casts_itself", False):   # FP8 weights and their scales keep their dtype here
            tensor = tensor.to(param.dtype)
        if shard_id is None:
            loader(param, tensor, name)
        else:
            loader(param, tensor, name, shard_id)
        self.loaded.add(target if shard_id is None else f"{target}:{shard_id}")

    def check_complete(self, checkpoint: Path) -> None:
        _check_complete(self.params, self.packed, self.loaded, self.tied, checkpoint)


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
