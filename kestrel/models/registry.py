"""HF architecture name -> model class."""
from __future__ import annotations

from torch import nn

from kestrel.errors import ModelLoadError
from kestrel.models.deepseek_v3 import DeepseekV3ForCausalLM
from kestrel.models.glm4_moe import Glm4MoeForCausalLM
from kestrel.models.llama import LlamaForCausalLM
from kestrel.models.llama_moe import MixtralForCausalLM, Qwen3MoeForCausalLM
from kestrel.models.model_config import ModelConfig

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "Glm4MoeForCausalLM": Glm4MoeForCausalLM,
}


def model_class(cfg: ModelConfig) -> type[nn.Module]:
    try:
        return MODEL_CLASSES[cfg.architecture]
    except KeyError:
        raise ModelLoadError(f"architecture {cfg.architecture!r} is not supported; supported: "
                             f"{', '.join(MODEL_CLASSES)}") from None
