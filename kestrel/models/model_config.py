"""ModelConfig: the fields of a HF config.json that the Llama family needs, read once and frozen."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kestrel.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool           # Qwen2
    qk_norm: bool            # Qwen3: RMSNorm over each head of q and k before rotary
    sliding_window: int | None
    torch_dtype: str | None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    quantization_config: dict[str, Any] | None = None   # as config.json has it; models/quantization.py reads it


def _as_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def hf_model_config(model_dir: Path) -> ModelConfig:
    """The ModelConfig of an HF checkpoint directory (its config.json)."""
    path = model_dir / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{path} not found: a checkpoint directory needs config.json")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from None
    architectures = raw.get("architectures") or []
    arch = architectures[0] if architectures else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"{path}: architecture {arch!r} is not supported; supported: "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    try:
        hidden = int(raw["hidden_size"])
        num_heads = int(raw["num_attention_heads"])
        rope = raw.get("rope_parameters") or {}
        rope_theta = float(raw.get("rope_theta") or rope.get("rope_theta") or 10000.0)
        scaling = raw.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if scaling is not None:
            scaling = dict(scaling)
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            if kind not in ("default", "llama3"):
                raise ModelLoadError(f"{path}: rope scaling type {kind!r} is not supported (default, llama3)")
            if kind == "default":
                scaling = None
        window = raw.get("sliding_window")
        if arch == "Qwen2ForCausalLM" and not raw.get("use_sliding_window", False):
            window = None
        if arch == "Qwen3ForCausalLM" and not raw.get("use_sliding_window", False):
            window = None
        default_bias = arch == "Qwen2ForCausalLM"
        return ModelConfig(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(raw.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=bool(raw.get("attention_bias", default_bias)) or default_bias,
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_window=int(window) if window else None,
            torch_dtype=raw.get("dtype") or raw.get("torch_dtype"),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_as_tuple(raw.get("eos_token_id")),
            quantization_config=raw.get("quantization_config"),
        )
    except KeyError as exc:
        raise ModelLoadError(f"{path} lacks the field {exc.args[0]!r}") from None
