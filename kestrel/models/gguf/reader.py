"""Open a GGUF file (cached) and map its llama.cpp metadata onto Kestrel's ModelConfig / an HF config.json."""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from kestrel.errors import ModelLoadError
from kestrel.models.model_config import ModelConfig

# GGUF `general.architecture` values Kestrel runs, and the HF class each maps to. llama.cpp writes Mistral
# checkpoints as "llama" too.
ARCHITECTURES = {"llama": "LlamaForCausalLM"}


def open_gguf(path: Path):
    """The parsed file (gguf.GGUFReader over a read-only memmap); one parse serves config, tokenizer and weights."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {path} does not exist")
    stat = path.stat()
    # mtime and size in the key: a file rewritten at the same path is parsed again.
    return _open(str(path.resolve()), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _open(path: str, mtime_ns: int, size: int):
    try:
        import gguf
    except ImportError:
        raise ModelLoadError("loading a .gguf file needs the `gguf` package: pip install gguf==0.19.0") from None
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(f"{path} is not a GGUF file (its first bytes are {magic!r}, expected b'GGUF')")
    try:
        return gguf.GGUFReader(path, "r")
    except Exception as exc:  # the reader raises ValueError/IndexError/struct errors for cut or corrupt files
        raise ModelLoadError(f"{path} cannot be read as GGUF, it is truncated or corrupt "
                             f"({type(exc).__name__}: {exc})") from None


def field(reader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    try:
        return f.contents()
    except Exception as exc:  # a field whose bytes do not decode: the file is corrupt
        raise ModelLoadError(f"{reader.data.filename}: metadata field {key!r} is unreadable ({exc})") from None


def architecture(reader) -> str:
    arch = field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(f"{reader.data.filename}: GGUF architecture {arch!r} is not supported; "
                             f"supported: {', '.join(ARCHITECTURES)}")
    return arch


def _required(reader, key: str) -> Any:
    value = field(reader, key)
    if value is None:
        raise ModelLoadError(f"{reader.data.filename}: GGUF metadata lacks {key!r}")
    return value


def tensor_names(reader) -> set[str]:
    return {t.name for t in reader.tensors}


def hf_config(reader) -> dict[str, Any]:
    """The checkpoint's config as HF's config.json fields (what `kestrel convert` writes)."""
    arch = architecture(reader)
    p = f"{arch}."
    names = tensor_names(reader)
    hidden = int(_required(reader, p + "embedding_length"))
    heads = int(_required(reader, p + "attention.head_count"))
    kv_heads = int(field(reader, p + "attention.head_count_kv", heads))
    head_dim = int(field(reader, p + "attention.key_length", hidden // heads))
    rope_dim = int(field(reader, p + "rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ModelLoadError(f"{reader.data.filename}: partial rotary ({rope_dim} of {head_dim} dims) "
                             "is not supported")
    scaling = field(reader, p + "rope.scaling.type")
    if scaling not in (None, "none") or "rope_freqs.weight" in names:
        # llama.cpp stores Llama-3.1's rope scaling as precomputed per-frequency factors, not HF's parameters.
        raise ModelLoadError(f"{reader.data.filename}: rope scaling ({scaling or 'rope_freqs'}) in GGUF files "
                             "is not supported yet")
    tokens = field(reader, "tokenizer.ggml.tokens") or []
    vocab = int(field(reader, p + "vocab_size", 0) or len(tokens))
    if vocab == 0:
        raise ModelLoadError(f"{reader.data.filename}: GGUF metadata gives no vocabulary size")
    eos = field(reader, "tokenizer.ggml.eos_token_id")
    eot = field(reader, "tokenizer.ggml.eot_token_id")
    eos_ids = [int(i) for i in (eos, eot) if i is not None]
    return {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(_required(reader, p + "feed_forward_length")),
        "num_hidden_layers": int(_required(reader, p + "block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": float(field(reader, p + "attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(field(reader, p + "rope.freq_base", 10000.0)),
        "max_position_embeddings": int(field(reader, p + "context_length", 2048)),
        # No output.weight: the LM head reuses the embedding (llama.cpp drops the duplicate when writing).
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "hidden_act": "silu",
        "bos_token_id": field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else (eos_ids or None),
    }


def gguf_model_config(path: Path) -> ModelConfig:
    raw = hf_config(open_gguf(path))
    eos = raw["eos_token_id"]
    return ModelConfig(
        architecture=raw["architectures"][0],
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=raw["num_attention_heads"],
        num_kv_heads=raw["num_key_value_heads"],
        head_dim=raw["head_dim"],
        rms_norm_eps=raw["rms_norm_eps"],
        rope_theta=raw["rope_theta"],
        rope_scaling=None,
        max_position_embeddings=raw["max_position_embeddings"],
        tie_word_embeddings=raw["tie_word_embeddings"],
        qkv_bias=raw["attention_bias"],
        qk_norm=False,
        sliding_window=None,
        torch_dtype=None,   # quantized weights: the engine's dtype decides (bf16 on CUDA, fp32 on CPU)
        bos_token_id=raw["bos_token_id"],
        eos_token_ids=tuple([eos] if isinstance(eos, int) else (eos or [])),
    )
