"""Small synthetic GGUF files for the loader's tests, written with gguf.GGUFWriter."""
from __future__ import annotations

from pathlib import Path

import numpy as np


def byte_tokens() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes (what byte-level BPE vocabularies list)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, n = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return [chr(c) for c in chars]


def write_llama_gguf(path: Path, arch: str = "llama", types: dict[str, object] | None = None, hidden: int = 64,
                     heads: int = 2, kv_heads: int = 1, ffn: int = 64, seed: int = 0) -> dict[str, np.ndarray]:
    """A one-layer Llama GGUF with random weights; `types` maps a GGUF tensor name to the quant type it is
    written in (default F32). Returns the float32 weights (GGUF names, HF row order) that were written."""
    import gguf
    from gguf import quants

    types = types or {}   # name -> GGMLQuantizationType, or (type, uint8 bytes in the type's byte shape)
    rng = np.random.default_rng(seed)
    tokens = byte_tokens() + ["Ġt", "<|end|>"]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * (len(tokens) - 1) + [3])
    w.add_token_merges(["Ġ t"])
    w.add_bos_token_id(len(tokens) - 1)
    w.add_eos_token_id(len(tokens) - 1)
    head_dim = hidden // heads
    shapes = {"token_embd.weight": (len(tokens), hidden), "output_norm.weight": (hidden,),
              "blk.0.attn_norm.weight": (hidden,), "blk.0.ffn_norm.weight": (hidden,),
              "blk.0.attn_q.weight": (heads * head_dim, hidden), "blk.0.attn_k.weight": (kv_heads * head_dim, hidden),
              "blk.0.attn_v.weight": (kv_heads * head_dim, hidden), "blk.0.attn_output.weight": (hidden, hidden),
              "blk.0.ffn_gate.weight": (ffn, hidden), "blk.0.ffn_up.weight": (ffn, hidden),
              "blk.0.ffn_down.weight": (hidden, ffn)}
    written = {}
    for name, shape in shapes.items():
        x = (1.0 + 0.1 * rng.standard_normal(shape) if "norm" in name else 0.1 * rng.standard_normal(shape))
        x = x.astype(np.float32)
        written[name] = x
        kind = types.get(name, gguf.GGMLQuantizationType.F32)
        if isinstance(kind, tuple):   # (type, raw bytes): a type gguf cannot quantize, written as given
            w.add_tensor(name, kind[1], raw_dtype=kind[0])
        elif kind == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, x)
        else:
            w.add_tensor(name, quants.quantize(x, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written
