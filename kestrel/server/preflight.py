"""What `kestrel serve` checks before the HTTP port opens: everything that can be known without loading weights.

The port opens while the engine loads (so /health can report the phases), which means an error found by the
engine comes after uvicorn has started. The common first-contact mistakes — a wrong path, a directory that is not
a checkpoint, a config.json Kestrel cannot read, a --max-model-len beyond the model's — are caught here instead,
in the CLI process and without torch, so they end in one `error:` line and a non-zero exit before anything
listens. The engine repeats these checks (forward/startup.py) for `LLM(...)` and for anything that slips past.
"""
from __future__ import annotations


from kestrel.config import EngineConfig
from kestrel.errors import KestrelError, ModelLoadError
from kestrel.models.gguf import is_gguf
from kestrel.models.model_config import ModelConfig, hf_model_config


def check_before_serving(config: EngineConfig) -> ModelConfig:
    """Raise KestrelError for a model that could never load; the model's config otherwise."""
    path = config.model_path   # a short name (smollm2) whose package is missing raises here
    if is_gguf(path):
        if not path.is_file():
            raise ModelLoadError(f"GGUF file {path} does not exist")
        from kestrel.models.gguf.reader import gguf_model_config
        model_config = gguf_model_config(path)
    elif not path.is_dir():
        if config.model is None:
            raise ModelLoadError(f"the embedded default model is missing at {path}; pass a model directory")
        raise ModelLoadError(f"model directory {path} does not exist (Kestrel loads local HF checkpoints "
                             "and .gguf files)")
    else:
        model_config = hf_model_config(path)
    if config.tokenizer is not None and not config.tokenizer_path.exists():
        raise KestrelError(f"--tokenizer {config.tokenizer} does not exist")
    if config.max_model_len is not None and config.max_model_len > model_config.max_position_embeddings:
        raise KestrelError(f"--max-model-len {config.max_model_len} exceeds the model's max_position_embeddings "
                           f"({model_config.max_position_embeddings})")
    return model_config
