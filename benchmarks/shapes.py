"""Real model shapes with random weights, written as HF checkpoints (sharded bf16 safetensors) on the GPU box.

The tokenizer is a word-level one with exactly the model's vocabulary ("t0" .. "tN"), so every sampled id
detokenizes and the text path costs what it would with a real tokenizer of that size.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

SHAPES: dict[str, dict] = {
    "llama-3.1-8b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
        bos_token_id=0, eos_token_id=1, torch_dtype="bfloat16"),
    "qwen3-0.6b": dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=1024, intermediate_size=3072,
        num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
        max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
        attention_bias=False, bos_token_id=0, eos_token_id=1, torch_dtype="bfloat16"),
}


def tensor_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (v, h)
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        shapes.update({
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h), p + "mlp.down_proj.weight": (h, i),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
        })
        if cfg["model_type"] == "qwen3":
            shapes[p + "self_attn.q_norm.weight"] = (hd,)
            shapes[p + "self_attn.k_norm.weight"] = (hd,)
    return shapes


def write_random_checkpoint(name: str, out: Path, shard_bytes: int = 4 << 30, seed: int = 0) -> Path:
    """Random bf16 weights (std 0.02, norms ~1) built on the GPU and saved as sharded safetensors."""
    from safetensors.torch import save_file

    cfg = SHAPES[name]
    # Written last: a checkpoint left complete by an earlier process of the same run (the engine and HF benches
    # run in separate processes) is reused rather than written again (30 s for the 8B shape).
    marker, stamp = out / ".complete", json.dumps({"config": cfg, "seed": seed}, sort_keys=True)
    if marker.is_file() and marker.read_text() == stamp:
        return out
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shapes = tensor_shapes(cfg)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for tname, shape in shapes.items():
        nbytes = math.prod(shape) * 2
        if size + nbytes > shard_bytes and shards[-1]:
            shards.append({})
            size = 0
        if len(shape) == 1:
            t = 1.0 + 0.05 * torch.randn(shape, generator=gen, device="cuda")
        else:
            t = 0.02 * torch.randn(shape, generator=gen, device="cuda")
        shards[-1][tname] = t.to(torch.bfloat16)
        size += nbytes
    weight_map = {}
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: t.cpu() for n, t in shard.items()}, str(out / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in shard})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    write_wordlevel_tokenizer(out, cfg["vocab_size"])
    marker.write_text(stamp)
    return out


def write_wordlevel_tokenizer(out: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t0", eos_token="t1", unk_token="t2")
    fast.save_pretrained(str(out))
