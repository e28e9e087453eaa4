"""Real model shapes with random weights, written as HF checkpoints (sharded bf16 safetensors) on the GPU box.

The mixture-of-experts shapes are benchmarked with `--load-format dummy` (random weights made on the device), for
which `write_config_only` writes config.json and the tokenizer: Qwen3-30B-A3B's 61 GB of bf16 would take longer to
write and read than the whole benchmark. The "-tiny" shapes are the same architectures small enough for the CPU
(benchmarks/moe_bench.py --quick, its test).

The tokenizer is a word-level one with exactly the model's vocabulary ("<s>", "</s>", "<unk>", then "t3" .. "tN"),
so every sampled id detokenizes and the text path costs what it would with a real tokenizer of that size.
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
    # Qwen3-30B-A3B's config.json (Qwen/Qwen3-30B-A3B) but for bos/eos, which are the word-level tokenizer's:
    # 48 layers, 128 experts of width 768, top-8 renormalised, 32 query / 4 KV heads of 128, 30.5 B parameters
    # (61.1 GB bf16), 3.3 B of them active per token
    "qwen3-30b-a3b": dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144,
        moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6,
        rope_theta=1000000.0, tie_word_embeddings=False, attention_bias=False, use_sliding_window=False,
        sliding_window=None, bos_token_id=0, eos_token_id=1, torch_dtype="bfloat16"),
    # DeepSeek-V2-Lite's widths (hidden 2048, 16 heads, latent 512, no q compression, 64 experts of 1408, 2 shared,
    # top-6) with DeepSeek-V3's router (sigmoid, 8 groups of 8, best 4 groups, scaling 2.5) and vocabulary, 16
    # layers: 9.4 B parameters (18.8 GB bf16), 1.6 B active per token
    "deepseek-v3-small": dict(
        architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", hidden_size=2048,
        intermediate_size=10944, moe_intermediate_size=1408, n_routed_experts=64, n_shared_experts=2,
        num_experts_per_tok=6, n_group=8, topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True,
        topk_method="noaux_tc", scoring_func="sigmoid", first_k_dense_replace=1, moe_layer_freq=1,
        num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=None,
        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, vocab_size=129280,
        max_position_embeddings=163840, rms_norm_eps=1e-6, rope_theta=10000.0,
        rope_scaling={"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
                      "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        tie_word_embeddings=False, attention_bias=False, num_nextn_predict_layers=0, bos_token_id=0,
        eos_token_id=1, torch_dtype="bfloat16"),
    # CPU-sized: the two architectures above at a few MB (moe_bench.py --quick)
    "qwen3-moe-tiny": dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=64, intermediate_size=128,
        moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        vocab_size=512, max_position_embeddings=1024, rms_norm_eps=1e-6, rope_theta=1000000.0,
        tie_word_embeddings=False, attention_bias=False, bos_token_id=0, eos_token_id=1, torch_dtype="bfloat16"),
    "deepseek-v3-tiny": dict(
        architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", hidden_size=64, intermediate_size=128,
        moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2,
        topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None,
        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, vocab_size=512, max_position_embeddings=1024,
        rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, attention_bias=False,
        bos_token_id=0, eos_token_id=1, torch_dtype="bfloat16"),
}


def is_moe(cfg: dict) -> bool:
    return bool(cfg.get("num_experts") or cfg.get("n_routed_experts") or cfg.get("num_local_experts"))


def write_config_only(name: str, out: Path) -> Path:
    """config.json and the word-level tokenizer, no weights: what `--load-format dummy` needs. Cheap, so it is
    written again each time (no completion marker to trust)."""
    cfg = SHAPES[name]
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.safetensors*"):   # a dummy-format directory must not look like a checkpoint
        stale.unlink()
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    write_wordlevel_tokenizer(out, cfg["vocab_size"])
    return out


def tensor_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    if is_moe(cfg):
        raise ValueError(f"{cfg['architectures'][0]}: mixture-of-experts shapes are benchmarked with "
                         "--load-format dummy (write_config_only), not written as checkpoints")
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

    # The special tokens get names no word contains: added tokens match anywhere in the text, so a bos named "t1"
    # would split "t100992" into "t1" + an unknown "00992".
    specials = ("<s>", "</s>", "<unk>")
    vocab = {**{name: i for i, name in enumerate(specials)}, **{f"t{i}": i for i in range(len(specials), vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    # A plain template (each message's words in order), so the chat endpoint and the chat benchmarks (router_bench)
    # run on these shapes too; random weights make any template's wording moot.
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    fast.save_pretrained(str(out))
