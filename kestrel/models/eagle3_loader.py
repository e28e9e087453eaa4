"""An EAGLE-3 drafter checkpoint directory -> a validated, loaded Eagle3Drafter (and a random one for tests and
benchmarks).

    config.json       architectures ["LlamaForCausalLMEagle3"], Llama fields, vocab_size = the target's,
                      draft_vocab_size, target_hidden_size, eagle_config.eagle_aux_hidden_state_layer_ids
    *.safetensors     fc.weight [H, 3 Ht], midlayer.{input_layernorm, hidden_norm, post_attention_layernorm,
                      self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj}, norm, lm_head [draft_vocab, H],
                      d2t int64 [draft_vocab], t2d bool [vocab], embed_tokens [vocab, H] (optional: else the
                      target's); any name may carry a `model.` prefix. Or pytorch_model.bin (the EAGLE
                      authors' published drafters, e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B)

Every mistake a user can make in a drafter checkpoint is one ModelLoadError that names the file and the problem.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from kestrel.errors import ModelLoadError
from kestrel.layers.ops import TORCH_OPS, LayerOps
from kestrel.models.eagle3 import EAGLE3_ARCHITECTURE, Eagle3Config, Eagle3Drafter
from kestrel.models.loader import checkpoint_files, open_weight_file
from kestrel.models.model_config import ModelConfig
from kestrel.models.weight_placer import IGNORED_SUFFIXES, WeightPlacer

VOCAB_MAPS = ("d2t", "t2d")   # buffers, not parameters: validated and copied here, not by the WeightPlacer
LAYER_TENSORS = ("input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight",
                 "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
REQUIRED_TENSORS = ("fc.weight", "norm.weight", "lm_head.weight") + tuple(f"midlayer.{n}" for n in LAYER_TENSORS)


def default_aux_layer_ids(num_target_layers: int) -> tuple[int, int, int]:
    """An early, a middle and a late layer's input, as vLLM and SGLang pick them when the checkpoint does not."""
    return (2, num_target_layers // 2, num_target_layers - 3)


def _read_config_json(model_dir: Path) -> tuple[Path, dict[str, Any]]:
    path = model_dir / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{path} not found: an EAGLE-3 drafter directory needs config.json")
    try:
        return path, json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from None


def _rope_scaling(raw: dict[str, Any], path: Path) -> dict[str, Any] | None:
    scaling = raw.get("rope_scaling")
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ("default", "llama3"):
        raise ModelLoadError(f"{path}: rope scaling type {kind!r} is not supported (default, llama3)")
    return None if kind == "default" else dict(scaling)


def _aux_layer_ids(raw: dict[str, Any], target: ModelConfig, path: Path) -> tuple[int, ...]:
    # Top level or under eagle_config, as vLLM reads it. Id j is the hidden state entering target layer j (vLLM's
    # reading; SGLang adds 1 to explicit ids, taking them as layer outputs); j == L is the final pre-norm stream.
    ids = raw.get("eagle_aux_hidden_state_layer_ids") or \
        (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    ids = default_aux_layer_ids(target.num_layers) if ids is None else tuple(ids)
    if len(ids) != 3 or not all(isinstance(j, int) and 0 <= j <= target.num_layers for j in ids):
        raise ModelLoadError(f"{path}: eagle_aux_hidden_state_layer_ids {list(ids)} must be exactly 3 target "
                             f"layer ids in 0..{target.num_layers} (the target has {target.num_layers} layers)")
    return ids


def eagle3_config(model_dir: Path, target: ModelConfig) -> Eagle3Config:
    """The drafter's config.json, checked against the target it will draft for."""
    path, raw = _read_config_json(model_dir)
    arch = (raw.get("architectures") or [None])[0]
    if arch != EAGLE3_ARCHITECTURE:
        raise ModelLoadError(f"{path}: architecture {arch!r} is not an EAGLE-3 drafter "
                             f"(expected {EAGLE3_ARCHITECTURE!r})")
    try:
        hidden = int(raw["hidden_size"])
        num_heads = int(raw["num_attention_heads"])
        vocab = int(raw["vocab_size"])
        cfg = Eagle3Config(
            hidden_size=hidden,
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(raw.get("head_dim") or hidden // num_heads),
            intermediate_size=int(raw["intermediate_size"]),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(raw.get("rope_theta") or 10000.0),
            rope_scaling=_rope_scaling(raw, path),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            vocab_size=vocab,
            draft_vocab_size=int(raw.get("draft_vocab_size") or vocab),
            target_hidden_size=int(raw.get("target_hidden_size") or hidden),
            aux_layer_ids=_aux_layer_ids(raw, target, path),
            qkv_bias=bool(raw.get("attention_bias", False)),
        )
    except KeyError as exc:
        raise ModelLoadError(f"{path} lacks the field {exc.args[0]!r}") from None
    if cfg.vocab_size != target.vocab_size:
        raise ModelLoadError(f"{path}: vocab_size {cfg.vocab_size} differs from the target model's vocabulary "
                             f"({target.vocab_size}); the drafter must be trained for this target")
    if not 0 < cfg.draft_vocab_size <= cfg.vocab_size:
        raise ModelLoadError(f"{path}: draft_vocab_size {cfg.draft_vocab_size} must be in 1..vocab_size "
                             f"({cfg.vocab_size})")
    if cfg.target_hidden_size != target.hidden_size:
        raise ModelLoadError(f"{path}: target_hidden_size {cfg.target_hidden_size} differs from the target "
                             f"model's hidden_size ({target.hidden_size})")
    return cfg


class _TensorIndex:
    """Checkpoint tensor names (the `model.` prefix dropped) -> their file, read lazily."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self.files: dict[str, Path] = {}
        self.raw_names: dict[str, str] = {}
        for path in checkpoint_files(model_dir):
            with open_weight_file(path) as f:
                for name in f.keys():
                    short = name.removeprefix("model.")
                    self.files[short], self.raw_names[short] = path, name

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def where(self, name: str) -> str:
        return str(self.files[name])

    def shape(self, name: str) -> tuple[int, ...]:
        with open_weight_file(self.files[name]) as f:
            return tuple(f.get_slice(self.raw_names[name]).get_shape())

    def tensor(self, name: str) -> torch.Tensor:
        with open_weight_file(self.files[name]) as f:
            return f.get_tensor(self.raw_names[name])


def _check_tensors(index: _TensorIndex, cfg: Eagle3Config) -> None:
    missing = [n for n in REQUIRED_TENSORS if n not in index]
    if missing:
        raise ModelLoadError(f"EAGLE-3 drafter in {index.model_dir} lacks tensor(s): {', '.join(missing)}")
    fc_shape = index.shape("fc.weight")
    expected = (cfg.hidden_size, len(cfg.aux_layer_ids) * cfg.target_hidden_size)
    if fc_shape != expected:
        raise ModelLoadError(f"{index.where('fc.weight')}: fc.weight has shape {list(fc_shape)}, expected "
                             f"{list(expected)} = [hidden_size, 3 x target_hidden_size]")


def _shared_embedding(cfg: Eagle3Config, target_model: nn.Module, model_dir: Path) -> nn.Module:
    embedding = getattr(target_model, "embed_tokens", None)
    if embedding is None:
        raise ModelLoadError(f"EAGLE-3 drafter in {model_dir} has no embed_tokens and the target model has none "
                             "to share")
    width = embedding.weight.shape[1]
    if width != cfg.hidden_size:
        raise ModelLoadError(f"EAGLE-3 drafter in {model_dir} has no embed_tokens, and the target's embedding "
                             f"dim ({width}) differs from the drafter's hidden_size ({cfg.hidden_size}); it needs "
                             "its own embed_tokens.weight")
    return embedding


def _vocab_maps(index: _TensorIndex, cfg: Eagle3Config) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d), checked: every draft id maps into the target vocabulary and t2d marks exactly those ids."""
    draft, vocab = cfg.draft_vocab_size, cfg.vocab_size
    if "d2t" not in index:
        if draft < vocab:
            raise ModelLoadError(f"EAGLE-3 drafter in {index.model_dir} lacks the 'd2t' tensor, needed to map its "
                                 f"draft vocabulary ({draft}) into the target's ({vocab})")
        d2t = torch.zeros(draft, dtype=torch.int64)
    else:
        d2t = index.tensor("d2t")
        where = index.where("d2t")
        if tuple(d2t.shape) != (draft,) or d2t.is_floating_point():
            raise ModelLoadError(f"{where}: d2t has shape {list(d2t.shape)} and dtype {d2t.dtype}, expected an "
                                 f"integer tensor of shape [{draft}] (draft_vocab_size)")
        d2t = d2t.long()
        target_ids = torch.arange(draft) + d2t
        if int(target_ids.min()) < 0 or int(target_ids.max()) >= vocab:
            raise ModelLoadError(f"{where}: d2t maps draft ids to target ids outside the target vocabulary "
                                 f"0..{vocab - 1} (range {int(target_ids.min())}..{int(target_ids.max())})")
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[torch.arange(draft) + d2t] = True
    if "t2d" in index:
        given = index.tensor("t2d")
        if tuple(given.shape) != (vocab,) or not torch.equal(given.bool(), t2d):
            raise ModelLoadError(f"{index.where('t2d')}: t2d (shape {list(given.shape)}) does not mark exactly the "
                                 f"target ids that d2t maps to (expected a bool tensor of shape [{vocab}])")
    return d2t, t2d


def load_eagle3_drafter(path: str | Path, target_config: ModelConfig, target_model: nn.Module,
                        device: torch.device | str, dtype: torch.dtype, ops: LayerOps = TORCH_OPS) -> Eagle3Drafter:
    """A drafter checkpoint directory, validated against its target, on `device` in `dtype`."""
    model_dir = Path(path)
    if not model_dir.is_dir():
        raise ModelLoadError(f"EAGLE-3 drafter directory {model_dir} does not exist")
    cfg = eagle3_config(model_dir, target_config)
    index = _TensorIndex(model_dir)
    _check_tensors(index, cfg)
    cfg = replace(cfg, has_embedding="embed_tokens.weight" in index, fc_bias="fc.bias" in index)
    shared = None if cfg.has_embedding else _shared_embedding(cfg, target_model, model_dir)
    d2t, t2d = _vocab_maps(index, cfg)
    with torch.device(device):
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            drafter = Eagle3Drafter(cfg, ops, shared)
        finally:
            torch.set_default_dtype(default_dtype)
    rotary = drafter.midlayer.self_attn.rotary
    rotary.cos_sin_cache = rotary.cos_sin_cache.float()   # keep rotary tables in fp32
    _place_weights(drafter, index)
    drafter.d2t.copy_(d2t)
    drafter.t2d.copy_(t2d)
    return drafter.eval()


def _place_weights(drafter: Eagle3Drafter, index: _TensorIndex) -> None:
    placer = WeightPlacer(drafter)
    for name in index.files:
        if name in VOCAB_MAPS or name.endswith(IGNORED_SUFFIXES):
            continue
        try:
            placer.place(name, index.tensor(name), index.where(name))
        except ModelLoadError as exc:   # a shape mismatch names the tensor; name its file too
            if index.where(name) in str(exc):
                raise
            raise ModelLoadError(f"{index.where(name)}: {exc}") from None
    placer.check_complete(index.model_dir)


def drafter_config_json(target_config: ModelConfig, draft_vocab_size: int | None = None,
                        hidden_size: int | None = None, aux_layer_ids: tuple[int, ...] | None = None
                        ) -> dict[str, Any]:
    """config.json of a drafter for `target_config`: the standard EAGLE-3 shape (the target's width, heads, KV
    heads, head_dim, FFN and rotary; one layer), as SGLang and vLLM read it."""
    hidden = hidden_size or target_config.hidden_size
    aux = aux_layer_ids or default_aux_layer_ids(target_config.num_layers)
    return {
        "architectures": [EAGLE3_ARCHITECTURE], "model_type": "llama", "hidden_size": hidden,
        "num_attention_heads": target_config.num_heads, "num_key_value_heads": target_config.num_kv_heads,
        "head_dim": target_config.head_dim, "intermediate_size": target_config.intermediate_size,
        "rms_norm_eps": target_config.rms_norm_eps, "rope_theta": target_config.rope_theta,
        "rope_scaling": target_config.rope_scaling,
        "max_position_embeddings": target_config.max_position_embeddings, "num_hidden_layers": 1,
        "vocab_size": target_config.vocab_size, "draft_vocab_size": draft_vocab_size or target_config.vocab_size,
        "target_hidden_size": target_config.hidden_size, "tie_word_embeddings": False,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux)},
    }


def random_eagle3_checkpoint(out_dir: Path, target_config: ModelConfig, hidden_size: int | None = None,
                             draft_vocab_size: int | None = None, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                             with_embedding: bool = False, random_vocab_subset: bool = False,
                             **overrides: Any) -> Path:
    """A drafter for `target_config` in the standard format with random weights (tests, the GPU benchmark).

    Shapes default to the target's (hidden, heads, kv heads, head_dim, FFN), the standard EAGLE-3 size; overrides
    replace config.json fields. d2t maps the draft vocabulary onto the first draft_vocab_size target ids, or onto a
    random sorted subset."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    raw = drafter_config_json(target_config, draft_vocab_size, hidden_size)
    raw.update(overrides)
    draft_vocab = raw["draft_vocab_size"]
    (out_dir / "config.json").write_text(json.dumps(raw, indent=2))
    generator = torch.Generator().manual_seed(seed)
    tensors = _random_tensors(raw, generator, dtype, with_embedding)
    if random_vocab_subset:
        target_ids = torch.randperm(raw["vocab_size"], generator=generator)[:draft_vocab].sort().values
    else:
        target_ids = torch.arange(draft_vocab)
    tensors["d2t"] = target_ids - torch.arange(draft_vocab)
    t2d = torch.zeros(raw["vocab_size"], dtype=torch.bool)
    t2d[target_ids] = True
    tensors["t2d"] = t2d
    save_file(tensors, str(out_dir / "model.safetensors"))
    return out_dir


def _random_tensors(raw: dict[str, Any], generator: torch.Generator, dtype: torch.dtype,
                    with_embedding: bool) -> dict[str, torch.Tensor]:
    """Every weight of the drafter, named as the standard checkpoint names it; small enough that activations stay
    finite through the layer (std 0.02, norms near 1)."""
    h, ht = raw["hidden_size"], raw.get("target_hidden_size") or raw["hidden_size"]
    heads, kv_heads = raw["num_attention_heads"], raw.get("num_key_value_heads") or raw["num_attention_heads"]
    hd, ffn = raw.get("head_dim") or h // heads, raw["intermediate_size"]
    shapes = {
        "fc.weight": (h, 3 * ht), "norm.weight": (h,), "lm_head.weight": (raw["draft_vocab_size"], h),
        "midlayer.input_layernorm.weight": (h,), "midlayer.hidden_norm.weight": (h,),
        "midlayer.post_attention_layernorm.weight": (h,),
        "midlayer.self_attn.q_proj.weight": (heads * hd, 2 * h),
        "midlayer.self_attn.k_proj.weight": (kv_heads * hd, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kv_heads * hd, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, heads * hd),
        "midlayer.mlp.gate_proj.weight": (ffn, h), "midlayer.mlp.up_proj.weight": (ffn, h),
        "midlayer.mlp.down_proj.weight": (h, ffn),
    }
    if with_embedding:
        shapes["embed_tokens.weight"] = (raw["vocab_size"], h)
    tensors = {}
    for name, shape in shapes.items():
        base = 1.0 if len(shape) == 1 else 0.0
        tensors[name] = (base + 0.02 * torch.randn(shape, generator=generator)).to(dtype)
    return tensors
