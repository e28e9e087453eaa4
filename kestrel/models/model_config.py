"""ModelConfig: the fields of a HF config.json that the supported models need, read once and frozen.

The Llama family's fields first; partial rotary (GLM-4-MoE), mixture of experts (Qwen3-MoE, Mixtral, DeepSeek-V3,
GLM-4-MoE) and multi-head latent attention (DeepSeek-V3) add theirs with defaults that mean "not this model"
(rotary_dim 0, 0 experts, kv_lora_rank 0)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kestrel.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM",
                           "Qwen3MoeForCausalLM", "MixtralForCausalLM", "DeepseekV3ForCausalLM", "Glm4MoeForCausalLM")


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
    rotary_dim: int = 0                   # partial rotary (GLM-4-MoE): the first rotary_dim dims of a head; 0: all
    # Mixture of experts (kestrel/layers/moe.py); num_experts 0: every layer has the dense MLP
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False          # renormalise the chosen experts' weights to sum to 1
    dense_layers: tuple[int, ...] = ()    # layers that keep the dense MLP in a MoE model
    n_shared_experts: int = 0             # DeepSeek: an always-on MLP of n_shared * moe_intermediate_size
    n_group: int = 1                      # DeepSeek: experts in n_group groups, tokens choose topk_group groups
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    # Multi-head latent attention (kestrel/attention/mla.py); kv_lora_rank 0: not MLA
    kv_lora_rank: int = 0
    q_lora_rank: int | None = None        # None: q comes from one q_proj
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0             # == head_dim for MLA models (the rotary table's width)
    v_head_dim: int = 0
    rope_interleave: bool = False         # rotary pairs (x0, x1), (x2, x3), ... instead of the two halves
    quantization_config: dict[str, Any] | None = None   # as config.json has it; models/quantization.py reads it
    # DeepSeek-V3 / GLM-4.5: multi-token-prediction layers stored past the decoder as model.layers.{num_layers + i}
    # (a drafter for speculative decoding: models/deepseek_mtp.py); 0: the checkpoint carries none
    num_nextn_predict_layers: int = 0


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
            if kind not in ("default", "llama3", "yarn"):
                raise ModelLoadError(f"{path}: rope scaling type {kind!r} is not supported (default, llama3, yarn)")
            if kind == "yarn" and "original_max_position_embeddings" not in scaling:
                scaling["original_max_position_embeddings"] = int(raw.get("original_max_position_embeddings")
                                                                  or raw.get("max_position_embeddings", 2048))
            if kind == "default":
                scaling = None
        window = raw.get("sliding_window")
        if arch == "Qwen2ForCausalLM" and not raw.get("use_sliding_window", False):
            window = None
        if arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM") and not raw.get("use_sliding_window", False):
            window = None
        default_bias = arch == "Qwen2ForCausalLM"
        mla = arch == "DeepseekV3ForCausalLM"
        return ModelConfig(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            # MLA: the rotary table covers the rope part of a head only
            head_dim=int(raw["qk_rope_head_dim"]) if mla else int(raw.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=bool(raw.get("attention_bias", default_bias)) or default_bias,
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM") or bool(raw.get("use_qk_norm", False)),
            sliding_window=int(window) if window else None,
            torch_dtype=raw.get("dtype") or raw.get("torch_dtype"),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_as_tuple(raw.get("eos_token_id")),
            rotary_dim=_rotary_dim(raw, rope, num_heads),
            **_moe_fields(arch, raw), **(_mla_fields(raw) if mla else {}),
            quantization_config=raw.get("quantization_config"),
            num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers") or 0),
        )
    except KeyError as exc:
        raise ModelLoadError(f"{path} lacks the field {exc.args[0]!r}") from None


def _moe_fields(arch: str, raw: dict[str, Any]) -> dict[str, Any]:
    """The MoE fields of each MoE architecture's config.json (each names them its own way)."""
    layers = int(raw["num_hidden_layers"])
    if arch == "Qwen3MoeForCausalLM":
        experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
        step = int(raw.get("decoder_sparse_step", 1))
        only_mlp = set(raw.get("mlp_only_layers") or ())
        dense = tuple(i for i in range(layers) if experts == 0 or i in only_mlp or (i + 1) % step)
        return dict(num_experts=experts, num_experts_per_tok=int(raw["num_experts_per_tok"]),
                    moe_intermediate_size=int(raw["moe_intermediate_size"]),
                    norm_topk_prob=bool(raw.get("norm_topk_prob", False)), dense_layers=dense)
    if arch == "MixtralForCausalLM":
        # Mixtral's experts are as wide as its intermediate_size; top-k then softmax == renormalised softmax top-k
        return dict(num_experts=int(raw["num_local_experts"]), num_experts_per_tok=int(raw["num_experts_per_tok"]),
                    moe_intermediate_size=int(raw["intermediate_size"]), norm_topk_prob=True)
    if arch in ("DeepseekV3ForCausalLM", "Glm4MoeForCausalLM"):   # the same router and shared experts
        experts = int(raw.get("n_routed_experts") or raw.get("num_local_experts") or 0)
        first_dense = int(raw.get("first_k_dense_replace", 0))
        return dict(num_experts=experts, num_experts_per_tok=int(raw["num_experts_per_tok"]),
                    moe_intermediate_size=int(raw["moe_intermediate_size"]),
                    norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
                    dense_layers=tuple(i for i in range(layers) if i < first_dense or experts == 0),
                    n_shared_experts=int(raw.get("n_shared_experts") or 0), n_group=int(raw.get("n_group") or 1),
                    topk_group=int(raw.get("topk_group") or 1),
                    routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)))
    return {}


def _rotary_dim(raw: dict[str, Any], rope: dict[str, Any], num_heads: int) -> int:
    """Rotated dims of a head when only a fraction rotates (partial_rotary_factor < 1), else 0 (all of them)."""
    factor = float(raw.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0)
    if factor >= 1.0:
        return 0
    head_dim = int(raw.get("head_dim") or int(raw["hidden_size"]) // num_heads)
    return int(head_dim * factor)


def _mla_fields(raw: dict[str, Any]) -> dict[str, Any]:
    q_lora = raw.get("q_lora_rank")
    return dict(kv_lora_rank=int(raw["kv_lora_rank"]), q_lora_rank=int(q_lora) if q_lora else None,
                qk_nope_head_dim=int(raw["qk_nope_head_dim"]), qk_rope_head_dim=int(raw["qk_rope_head_dim"]),
                v_head_dim=int(raw["v_head_dim"]), rope_interleave=bool(raw.get("rope_interleave", True)))
