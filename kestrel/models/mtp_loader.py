"""The multi-token-prediction drafter (models/deepseek_mtp.py) from its target's own checkpoint.

Its tensors are layer L = num_hidden_layers of the target checkpoint, which the target's load leaves unread
(models/llama_moe.py: is_past_last_layer); they are put into the drafter under these names:

    model.layers.L.{enorm, hnorm, eh_proj, shared_head.norm}.*   -> the same names
    model.layers.L.{self_attn, mlp, *_layernorm}.*               -> block.* (a decoder layer's names)
    model.layers.L.{embed_tokens, shared_head.head}.weight       -> unread: the target's embedding and lm_head
                                                                    are shared (the report's "shared embedding
                                                                    and output head"; SGLang shares them too)

Only the first MTP module is used, for every draft step (DeepSeek-V3 ships one). Every mistake is one
ModelLoadError naming the checkpoint and the tensor.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from kestrel.errors import ModelLoadError
from kestrel.layers.ops import TORCH_OPS, LayerOps
from kestrel.models.deepseek_mtp import MTPDrafter
from kestrel.models.loader import checkpoint_files, open_weight_file
from kestrel.models.model_config import ModelConfig
from kestrel.models.weight_placer import IGNORED_SUFFIXES, WeightPlacer

# targets whose MTP layer is a decoder layer of their own kind (vLLM: deepseek_mtp, glm4_moe_mtp)
MTP_ARCHITECTURES = ("DeepseekV3ForCausalLM", "Glm4MoeForCausalLM")
MODULE_OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.norm.")
SHARED_WITH_TARGET = ("embed_tokens.", "shared_head.head.")


def check_mtp_target(cfg: ModelConfig, model_dir: Path) -> None:
    """Refuse, before anything is loaded, a target that has no MTP layer to draft with."""
    if cfg.architecture not in MTP_ARCHITECTURES:
        raise ModelLoadError(f"speculative method deepseek_mtp needs a target with a multi-token-prediction layer "
                             f"({', '.join(MTP_ARCHITECTURES)}); {model_dir} is {cfg.architecture} (use eagle3 or "
                             "ngram)")
    if cfg.num_nextn_predict_layers < 1:
        raise ModelLoadError(f"{model_dir}: the checkpoint carries no multi-token-prediction layer (config.json "
                             "num_nextn_predict_layers is 0 or absent), which speculative method deepseek_mtp "
                             "drafts with; use eagle3 or ngram")
    if cfg.quantization_config:
        raise ModelLoadError(f"{model_dir}: speculative method deepseek_mtp loads float checkpoints only for now "
                             f"(quantization_config {cfg.quantization_config.get('quant_method', '?')!r}); "
                             "convert the checkpoint to bfloat16, or use eagle3 or ngram")


def mtp_tensor_names(model_dir: Path, layer: int) -> dict[str, tuple[Path, str]]:
    """name within the MTP layer -> (its file, its full checkpoint name), for model.layers.{layer}.*."""
    prefixes = (f"model.layers.{layer}.", f"layers.{layer}.")
    found: dict[str, tuple[Path, str]] = {}
    for path in checkpoint_files(model_dir):
        with open_weight_file(path) as f:
            for name in f.keys():
                prefix = next((p for p in prefixes if name.startswith(p)), None)
                if prefix is not None:
                    found[name[len(prefix):]] = (path, name)
    return found


def build_mtp_drafter(target: nn.Module, device: torch.device | str, dtype: torch.dtype, ops: LayerOps = TORCH_OPS,
                      embedding: nn.Module | None = None, head_weight: torch.Tensor | None = None) -> MTPDrafter:
    """The drafter's modules on `device` in `dtype`, weights not loaded (--load-format dummy fills them)."""
    with torch.device(device):
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            return MTPDrafter(target, ops, embedding, head_weight).eval()
        finally:
            torch.set_default_dtype(default_dtype)


def load_mtp_drafter(model_dir: Path, target: nn.Module, device: torch.device | str, dtype: torch.dtype,
                     ops: LayerOps = TORCH_OPS, embedding: nn.Module | None = None,
                     head_weight: torch.Tensor | None = None) -> MTPDrafter:
    """The MTP drafter of the loaded `target`, its weights from the target's checkpoint directory, on `device` in
    `dtype`. embedding / head_weight: whole tables where the target's are split over ranks."""
    model_dir = Path(model_dir)
    cfg: ModelConfig = target.config
    check_mtp_target(cfg, model_dir)
    layer = cfg.num_layers
    names = mtp_tensor_names(model_dir, layer)
    if not names:
        raise ModelLoadError(f"{model_dir}: config.json says num_nextn_predict_layers "
                             f"{cfg.num_nextn_predict_layers}, but no weight file holds model.layers.{layer}.* "
                             "(the multi-token-prediction layer; some conversions drop it)")
    drafter = build_mtp_drafter(target, device, dtype, ops, embedding, head_weight)
    placer = WeightPlacer(drafter)
    where = f"multi-token-prediction layer model.layers.{layer} in {model_dir}"
    for short, (path, full) in sorted(names.items()):
        if short.startswith(SHARED_WITH_TARGET) or short.endswith(IGNORED_SUFFIXES):
            continue
        own = short if short.startswith(MODULE_OWN) else f"block.{short}"
        with open_weight_file(path) as f:
            tensor = f.get_tensor(full)
        try:
            placer.place(own, tensor, f"{path.name}: {full}")
        except ModelLoadError as exc:   # a shape mismatch or a stray tensor: say which layer it came from
            raise ModelLoadError(f"{where}: {exc}") from None
    try:
        placer.check_complete(model_dir)
    except ModelLoadError as exc:
        raise ModelLoadError(f"{where}: {exc}".replace("block.", f"model.layers.{layer}.")) from None
    return drafter.eval()
