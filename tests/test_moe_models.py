"""Mixture-of-experts and latent-attention models against HF transformers, float32 on the CPU: tiny random
checkpoints written with save_pretrained (HF's own on-disk names), loaded by HF with from_pretrained (its router
in float32) as the oracle. Greedy tokens identical for 32 tokens, batched and alone, with prefix-cache hits;
last-token logits within 1e-4."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from kestrel import LLM, SamplingParams
from kestrel.batch import build_forward_batch
from tests.conftest import make_tokenizer

SYSTEM = "# A helper module.\nimport os\nimport sys\nimport json\n\n\ndef load(path):\n    with open(path) as f:\n"
PROMPTS = [SYSTEM + "        return json.load(f)\n", SYSTEM + "        data = f.read()\n", "import os",
           "class Stack:\n    def __init__(self):\n        self.items = []\n    def push(self, x):\n"]
MAX_TOKENS = 32

COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5,
              tie_word_embeddings=False)
CONFIGS = {
    # layer 1 keeps the dense MLP (mlp_only_layers); 8 experts, top-2, renormalised
    "qwen3_moe": ("qwen3_moe", dict(COMMON, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1])),
    # not renormalised, every second layer sparse (layers 1 and 3 of 4... here layer 1 of 0..2)
    "qwen3_moe_raw": ("qwen3_moe", dict(COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                        norm_topk_prob=False, decoder_sparse_step=2)),
    "mixtral": ("mixtral", dict(COMMON, num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
    "deepseek_v3": ("deepseek_v3", dict(hidden_size=256, intermediate_size=256, moe_intermediate_size=64,
                                        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                                        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2,
                                        topk_group=1, first_k_dense_replace=1, kv_lora_rank=64, q_lora_rank=96,
                                        qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
                                        routed_scaling_factor=2.5, norm_topk_prob=True,
                                        max_position_embeddings=256, rms_norm_eps=1e-5,
                                        tie_word_embeddings=False, rope_scaling=None)),
    # q from one q_proj (no q_lora_rank), no renormalisation
    "deepseek_v3_no_q_lora": ("deepseek_v3", dict(hidden_size=128, intermediate_size=128, moe_intermediate_size=32,
                                                  num_hidden_layers=2, num_attention_heads=4,
                                                  num_key_value_heads=4, n_routed_experts=8, n_shared_experts=2,
                                                  num_experts_per_tok=3, n_group=4, topk_group=2,
                                                  first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=None,
                                                  qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=24,
                                                  routed_scaling_factor=1.5, norm_topk_prob=False,
                                                  max_position_embeddings=256, rms_norm_eps=1e-5,
                                                  tie_word_embeddings=False, rope_scaling=None)),
    # YaRN: DeepSeek's released form (mscale = mscale_all_dim, so the softmax scale grows, the table does not)
    "deepseek_v3_yarn": ("deepseek_v3", dict(dict(
        hidden_size=128, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2,
        topk_group=1, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16,
        qk_nope_head_dim=16, v_head_dim=16, routed_scaling_factor=2.5, norm_topk_prob=True,
        max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False),
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 1.0,
                      "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1, "rope_theta": 10000.0})),
    # YaRN with the attention factor on the table (mscale alone)
    "qwen3_moe_yarn": ("qwen3_moe", dict(COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                         norm_topk_prob=True,
                                         rope_scaling={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                       "original_max_position_embeddings": 64})),
    # partial rotary (half of each head), q/k/v bias, q/k norm, DeepSeek's router with 2 groups, a dense layer 0
    "glm4_moe": ("glm4_moe", dict(COMMON, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                                  moe_intermediate_size=32, n_group=2, topk_group=1, first_k_dense_replace=1,
                                  routed_scaling_factor=1.8, norm_topk_prob=True, partial_rotary_factor=0.5,
                                  attention_bias=True, use_qk_norm=True)),
}


def make_moe_checkpoint(out: Path, name: str, seed: int = 0) -> Path:
    model_type, kwargs = CONFIGS[name]
    tokenizer = make_tokenizer()
    config = AutoConfig.for_model(model_type, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                  eos_token_id=tokenizer.eos_token_id, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():   # HF inits norms to 1 and the correction bias to 0: make every tensor matter
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif pname.endswith("bias"):
                p.copy_(0.05 * torch.randn_like(p))
            else:
                p.copy_(0.08 * torch.randn_like(p))
        for bname, b in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    return out


def hf_model(path: Path):
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def hf_greedy(hf, prompt_ids: list[list[int]], max_tokens: int) -> list[list[int]]:
    outs = []
    for ids in prompt_ids:
        x = torch.tensor([ids])
        g = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens, do_sample=False,
                        eos_token_id=None, pad_token_id=0)
        outs.append(g[0, len(ids):].tolist())
    return outs


NAMES = list(CONFIGS)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_greedy_tokens_match_hf_batched_and_alone_with_prefix_hits(moe_checkpoint, name):
    path = moe_checkpoint(name)
    llm = LLM(model=str(path), device="cpu", block_size=4)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    alone = [llm.generate([p], params)[0] for p in PROMPTS]          # one at a time: the cache warms
    batched = llm.generate(PROMPTS, params)                           # together, over the cached prefixes
    expected = hf_greedy(hf_model(path), [r.prompt_token_ids for r in batched], MAX_TOKENS)
    assert [r.outputs[0].token_ids for r in alone] == expected
    assert [r.outputs[0].token_ids for r in batched] == expected
    assert alone[1].num_cached_tokens > 0 and all(r.num_cached_tokens > 0 for r in batched)
    assert llm.engine.stats().prefix_cache_hits > 0


@pytest.mark.slow
@pytest.mark.parametrize("name", ["deepseek_v3", "qwen3_moe"])
def test_preemption_and_chunked_prefill_keep_hf_tokens(moe_checkpoint, name):
    """16-token steps (prompts prefilled in chunks over the latent / paged cache) and 32 blocks of 4 for 4
    sequences of up to ~110 tokens, so decodes run out of blocks and sequences are preempted and recomputed."""
    path = moe_checkpoint(name)
    llm = LLM(model=str(path), device="cpu", block_size=4, num_gpu_blocks_override=32, max_num_batched_tokens=16,
              disable_prefix_cache=True)
    results = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    assert llm.engine.scheduler.num_preemptions > 0
    expected = hf_greedy(hf_model(path), [r.prompt_token_ids for r in results], MAX_TOKENS)
    assert [r.outputs[0].token_ids for r in results] == expected
    assert llm.engine.pool.num_free == llm.engine.pool.num_blocks


@pytest.mark.parametrize("name", NAMES)
def test_last_token_logits_close_to_hf(moe_checkpoint, name):
    path = moe_checkpoint(name)
    llm = LLM(model=str(path), device="cpu")
    hf = hf_model(path)
    engine = llm.engine
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    tables = [engine.pool.allocate(-(-len(ids) // engine.pool.block_size)) for ids in prompts]
    ours = engine.runner.forward(build_forward_batch(prompts, [0] * len(prompts), tables,
                                                     engine.pool.block_size)).logits
    for i, ids in enumerate(prompts):
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0, -1]
        rel = (ours[i] - ref).norm() / ref.norm()
        assert rel < 1e-4, f"prompt {i}: relative error {rel:.2e}"
    for t in tables:
        engine.pool.release(t)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_decode_logits_over_the_cache_close_to_hf(moe_checkpoint, name):
    """Prefill a prompt, then one token at a time: every decode step's logits match HF's full forward."""
    path = moe_checkpoint(name)
    llm = LLM(model=str(path), device="cpu", block_size=4)
    hf = hf_model(path)
    engine = llm.engine
    ids = llm.tokenizer.encode(PROMPTS[3])
    extra = [5, 17, 200, 3, 99, 42]
    table = engine.pool.allocate(-(-(len(ids) + len(extra)) // 4))
    engine.runner.forward(build_forward_batch([ids], [0], [table], 4))
    seq = list(ids)
    for tok in extra:
        ours = engine.runner.forward(build_forward_batch([[tok]], [len(seq)], [table], 4)).logits[0]
        seq.append(tok)
        with torch.no_grad():
            ref = hf(torch.tensor([seq])).logits[0, -1]
        assert ((ours - ref).norm() / ref.norm()) < 1e-4
    engine.pool.release(table)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["deepseek_v3", "qwen3_moe"])
def test_speculative_verify_steps_keep_hf_tokens(moe_checkpoint, name):
    """Prompt-lookup drafts verified k + 1 tokens a step (over the latent cache for DeepSeek), rejected drafts
    rolled back: the tokens stay HF's."""
    path = moe_checkpoint(name)
    llm = LLM(model=str(path), device="cpu", block_size=4,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                  "prompt_lookup_max": 3, "adaptive": False})
    results = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    expected = hf_greedy(hf_model(path), [r.prompt_token_ids for r in results], MAX_TOKENS)
    assert [r.outputs[0].token_ids for r in results] == expected
    assert llm.engine.spec.counters.num_draft_tokens > 0


@pytest.mark.slow
@pytest.mark.parametrize("name", ["deepseek_v3", "glm4_moe"])
def test_multi_token_prediction_layer_past_the_decoder_is_skipped_at_load(moe_checkpoint, tmp_path, name):
    """Released checkpoints carry layer num_hidden_layers (the MTP module): loading leaves it unread."""
    import shutil

    from safetensors.torch import save_file

    path = tmp_path / name
    shutil.copytree(moe_checkpoint(name), path)
    layers = CONFIGS[name][1]["num_hidden_layers"]
    save_file({f"model.layers.{layers}.eh_proj.weight": torch.zeros(4, 4),
               f"model.layers.{layers}.mlp.experts.0.up_proj.weight": torch.zeros(4, 4)},
              str(path / "mtp.safetensors"))
    llm = LLM(model=str(path), device="cpu")
    out = llm.generate([PROMPTS[2]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert out[0].outputs[0].token_ids == hf_greedy(hf_model(moe_checkpoint(name)), [out[0].prompt_token_ids], 4)[0]


def test_config_reads_which_layers_are_dense_and_the_latent_cache_layout(moe_checkpoint):
    from kestrel.forward.runner import kv_bytes_per_block, kv_layout
    from kestrel.models.model_config import hf_model_config

    assert hf_model_config(moe_checkpoint("qwen3_moe")).dense_layers == (1,)          # mlp_only_layers
    assert hf_model_config(moe_checkpoint("qwen3_moe_raw")).dense_layers == (0, 2)    # decoder_sparse_step 2
    assert hf_model_config(moe_checkpoint("mixtral")).dense_layers == ()
    cfg = hf_model_config(moe_checkpoint("deepseek_v3"))
    assert cfg.dense_layers == (0,) and cfg.head_dim == 16                            # the rope part
    # one latent plane of one head, kv_lora_rank + rope wide, instead of K and V of every head
    assert kv_layout(cfg) == (1, 1, 64 + 16)
    assert kv_bytes_per_block(cfg, 16, torch.float32) == 3 * 16 * 80 * 4
    llm = LLM(model=str(moe_checkpoint("deepseek_v3")), device="cpu", block_size=4, num_gpu_blocks_override=10)
    assert tuple(llm.engine.runner.kv_cache.shape) == (3, 1, 10, 4, 1, 80)
