"""The EAGLE-3 drafter's contract: it loads the standard checkpoint format (SpecForge / SGLang / vLLM names), its
paged forward equals the layer's math in dense torch, and every bad drafter is one clear error."""
from __future__ import annotations

import json
import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kestrel.attention.torch_ref import TorchAttentionBackend
from kestrel.errors import KestrelError
from kestrel.batch import build_forward_batch
from kestrel.layers.ops import TORCH_OPS, LayerOps
from kestrel.models.eagle3_loader import load_eagle3_drafter, random_eagle3_checkpoint
from kestrel.models.llama import LlamaForCausalLM
from kestrel.models.model_config import ModelConfig
from tests.tolerances import scaled

TARGET = ModelConfig(architecture="LlamaForCausalLM", vocab_size=96, hidden_size=48, intermediate_size=64,
                     num_layers=6, num_heads=4, num_kv_heads=2, head_dim=12, rms_norm_eps=1e-5, rope_theta=10000.0,
                     rope_scaling=None, max_position_embeddings=128, tie_word_embeddings=False, qkv_bias=False,
                     qk_norm=False, sliding_window=None, torch_dtype=None)
HEADS, KV_HEADS, HEAD_DIM, FFN, EPS, THETA = 4, 2, 8, 40, 1e-5, 10000.0
BLOCK_SIZE, NUM_BLOCKS = 4, 16


@pytest.fixture(scope="module")
def target() -> LlamaForCausalLM:
    torch.manual_seed(1)
    model = LlamaForCausalLM(TARGET)
    model.embed_tokens.weight.data.normal_()
    return model


def drafter_tensors(hidden: int, target_hidden: int, draft_vocab: int, embed: bool, seed: int = 0
                    ) -> dict[str, torch.Tensor]:
    """Random weights under the exact names of the standard checkpoint format."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, base: float = 0.0, std: float = 0.1) -> torch.Tensor:
        return base + std * torch.randn(*shape, generator=g)

    t = {
        "fc.weight": rand(hidden, 3 * target_hidden), "fc.bias": rand(hidden),
        "midlayer.input_layernorm.weight": rand(hidden, base=1.0),
        "midlayer.hidden_norm.weight": rand(hidden, base=1.0),
        "midlayer.post_attention_layernorm.weight": rand(hidden, base=1.0),
        "midlayer.self_attn.q_proj.weight": rand(HEADS * HEAD_DIM, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": rand(KV_HEADS * HEAD_DIM, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": rand(KV_HEADS * HEAD_DIM, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": rand(hidden, HEADS * HEAD_DIM),
        "midlayer.mlp.gate_proj.weight": rand(FFN, hidden), "midlayer.mlp.up_proj.weight": rand(FFN, hidden),
        "midlayer.mlp.down_proj.weight": rand(hidden, FFN),
        "norm.weight": rand(hidden, base=1.0), "lm_head.weight": rand(draft_vocab, hidden),
    }
    if embed:
        t["embed_tokens.weight"] = rand(TARGET.vocab_size, hidden)
    if draft_vocab < TARGET.vocab_size:   # every other target id, so d2t is not the identity
        target_ids = torch.arange(draft_vocab) * (TARGET.vocab_size // draft_vocab)
        t["d2t"] = target_ids - torch.arange(draft_vocab)
        t["t2d"] = torch.zeros(TARGET.vocab_size, dtype=torch.bool).index_fill_(0, target_ids, True)
    return t


def write_drafter(out: Path, hidden: int = 32, target_hidden: int = 48, draft_vocab: int = 40, embed: bool = True,
                  prefix: str = "", drop: tuple[str, ...] = (), replace: dict[str, torch.Tensor] | None = None,
                  **config) -> tuple[Path, dict[str, torch.Tensor]]:
    out.mkdir(parents=True, exist_ok=True)
    raw = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": hidden,
           "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
           "intermediate_size": FFN, "rms_norm_eps": EPS, "rope_theta": THETA, "max_position_embeddings": 128,
           "num_hidden_layers": 1, "vocab_size": TARGET.vocab_size, "draft_vocab_size": draft_vocab,
           "target_hidden_size": target_hidden, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 6]}}
    raw.update(config)
    (out / "config.json").write_text(json.dumps(raw))
    tensors = drafter_tensors(hidden, target_hidden, draft_vocab, embed)
    tensors.update(replace or {})
    for name in drop:
        tensors.pop(name)
    # lm_head stays unprefixed, as in HF checkpoints whose other names carry `model.`
    named = {(n if n == "lm_head.weight" else prefix + n): t for n, t in tensors.items()}
    save_file(named, str(out / "drafter.safetensors"))
    return out, tensors


# --- the dense reference: the layer's math written out, no paging -----------------------------------------------

def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)


def dense_layer(t: dict[str, torch.Tensor], embeds: torch.Tensor, h0: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence at positions 0..n-1: (recurrent out [n, H], final-normed [n, H])."""
    n = embeds.shape[0]
    x = torch.cat([rms(embeds, t["midlayer.input_layernorm.weight"]), rms(h0, t["midlayer.hidden_norm.weight"])], -1)
    q = (x @ t["midlayer.self_attn.q_proj.weight"].T).view(n, HEADS, HEAD_DIM).transpose(0, 1)[None]
    k = (x @ t["midlayer.self_attn.k_proj.weight"].T).view(n, KV_HEADS, HEAD_DIM).transpose(0, 1)[None]
    v = (x @ t["midlayer.self_attn.v_proj.weight"].T).view(n, KV_HEADS, HEAD_DIM).transpose(0, 1)[None]
    inv_freq = 1.0 / THETA ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)
    freqs = torch.arange(n).float()[:, None] * inv_freq[None]
    emb = torch.cat([freqs, freqs], -1)[None]
    q, k = apply_rotary_pos_emb(q, k, emb.cos(), emb.sin())
    k, v = k.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1)
    attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)[0].transpose(0, 1).reshape(n, -1)
    h1 = attn @ t["midlayer.self_attn.o_proj.weight"].T + h0
    n2 = rms(h1, t["midlayer.post_attention_layernorm.weight"])
    mlp = (F.silu(n2 @ t["midlayer.mlp.gate_proj.weight"].T) * (n2 @ t["midlayer.mlp.up_proj.weight"].T)) \
        @ t["midlayer.mlp.down_proj.weight"].T
    out = mlp + h1
    return out, rms(out, t["norm.weight"])


def dense_sequence(t: dict[str, torch.Tensor], embed: torch.Tensor, tokens: torch.Tensor, aux: torch.Tensor,
                   num_steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fc(aux) for the prompt, then each later position fed the previous position's output, as a drafter runs."""
    h0 = aux @ t["fc.weight"].T + t["fc.bias"]
    for _ in range(num_steps):
        out, _ = dense_layer(t, embed[tokens[:h0.shape[0]]], h0)
        h0 = torch.cat([h0, out[-1:]])
    return dense_layer(t, embed[tokens], h0)


# --- tests ---------------------------------------------------------------------------------------------------------

def test_loads_the_standard_names_and_maps_draft_ids_to_target_ids(tmp_path, target):
    path, tensors = write_drafter(tmp_path / "d")
    drafter = load_eagle3_drafter(path, TARGET, target, "cpu", torch.float32)
    cfg = drafter.config
    assert (cfg.hidden_size, cfg.target_hidden_size, cfg.draft_vocab_size, cfg.vocab_size) == (32, 48, 40, 96)
    assert cfg.aux_layer_ids == (1, 3, 6) and cfg.has_embedding and cfg.fc_bias
    assert drafter.kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE) == (2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    assert torch.equal(drafter.draft_to_target(torch.tensor([0, 1, 39])), torch.tensor([0, 2, 78]))
    assert torch.equal(drafter.t2d, tensors["t2d"]) and drafter.d2t.dtype == torch.int64
    qkv = drafter.midlayer.self_attn.qkv_proj.weight
    assert qkv.shape == ((HEADS + 2 * KV_HEADS) * HEAD_DIM, 64)
    assert torch.equal(qkv[HEADS * HEAD_DIM:(HEADS + KV_HEADS) * HEAD_DIM], tensors["midlayer.self_attn.k_proj.weight"])
    assert torch.equal(drafter.midlayer.hidden_norm.weight, tensors["midlayer.hidden_norm.weight"])


def prologue_ops() -> LayerOps:
    """TORCH_OPS plus the torch twin of the fused attention prologue: the road the drafter takes on CUDA."""
    from kestrel.kernels.triton.attention_prologue import qk_norm_rope_store_ref

    return dataclasses.replace(TORCH_OPS, attn_prologue=qk_norm_rope_store_ref)


@pytest.mark.parametrize("embed,prologue", [(True, False), (False, False), (True, True)])
def test_paged_forward_equals_the_dense_layer_over_prefill_then_recurrent_steps(tmp_path, target, embed, prologue):
    # With its own embedding the drafter is narrower than the target (H 32, Ht 48); without, it shares the
    # target's embedding and so has the target's width.
    hidden = 32 if embed else 48
    path, t = write_drafter(tmp_path / "d", hidden=hidden, embed=embed)
    ops = prologue_ops() if prologue else TORCH_OPS
    drafter = load_eagle3_drafter(path, TARGET, target, "cpu", torch.float32, ops)
    embedding = t["embed_tokens.weight"] if embed else target.embed_tokens.weight.detach()
    backend = TorchAttentionBackend()
    cache = torch.zeros(drafter.kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE))
    g = torch.Generator().manual_seed(3)
    prompt_lens, num_steps = [5, 3, 7], 2
    blocks = torch.randperm(NUM_BLOCKS, generator=g)[:9].view(3, 3).tolist()   # 3 blocks hold 9 tokens
    tokens = [torch.randint(0, TARGET.vocab_size, (n + num_steps,), generator=g) for n in prompt_lens]
    aux = [torch.randn(n, 3 * TARGET.hidden_size, generator=g) for n in prompt_lens]

    batch = build_forward_batch([tok[:n].tolist() for tok, n in zip(tokens, prompt_lens)], [0, 0, 0], blocks,
                                BLOCK_SIZE)
    normed, out = drafter(batch, torch.cat(aux), backend, (cache[0], cache[1]))
    outs = [out.split(prompt_lens)]
    normeds = [normed]
    for step in range(num_steps):
        pos = [n + step for n in prompt_lens]
        batch = build_forward_batch([[int(tok[p])] for tok, p in zip(tokens, pos)], pos, blocks, BLOCK_SIZE)
        fed = torch.stack([o[-1] for o in outs[-1]])   # each sequence's last recurrent output
        normed, out = drafter(batch, fed, backend, (cache[0], cache[1]))
        outs.append(out.split(1))
        normeds.append(normed)

    for s, n in enumerate(prompt_lens):
        ref_out, ref_normed = dense_sequence(t, embedding, tokens[s], aux[s], num_steps)
        got = torch.cat([o[s] for o in outs])
        torch.testing.assert_close(got, ref_out, **scaled(dict(atol=1e-5, rtol=1e-5), ref_out))
        for step, normed in enumerate(normeds):   # logits_at: each sequence's last token of the step
            torch.testing.assert_close(normed[s], ref_normed[n - 1 + step],
                                       **scaled(dict(atol=1e-5, rtol=1e-5), ref_normed[n - 1 + step]))
    logits = drafter.compute_logits(normeds[-1])
    assert logits.shape == (3, 40) and logits.dtype == torch.float32
    ids = drafter.draft_to_target(logits.argmax(-1))
    assert bool(drafter.t2d[ids].all())


def test_logits_at_none_returns_every_row(tmp_path, target):
    path, _ = write_drafter(tmp_path / "d")
    drafter = load_eagle3_drafter(path, TARGET, target, "cpu", torch.float32)
    batch = build_forward_batch([[1, 2, 3]], [0], [[0]], BLOCK_SIZE)
    batch.logits_at = None
    cache = torch.zeros(drafter.kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE))
    normed, out = drafter(batch, torch.randn(3, 3 * 48), TorchAttentionBackend(), (cache[0], cache[1]))
    assert normed.shape == out.shape == (3, 32)


def test_loads_names_with_the_model_prefix(tmp_path, target):
    plain, tensors = write_drafter(tmp_path / "plain")
    prefixed, _ = write_drafter(tmp_path / "prefixed", prefix="model.")
    a = load_eagle3_drafter(plain, TARGET, target, "cpu", torch.float32)
    b = load_eagle3_drafter(prefixed, TARGET, target, "cpu", torch.float32)
    for (name, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(pa, pb), name
    assert torch.equal(b.embed_tokens.weight, tensors["embed_tokens.weight"])


def test_without_embed_tokens_it_shares_the_target_embedding(tmp_path, target):
    path, _ = write_drafter(tmp_path / "d", hidden=48, embed=False)
    drafter = load_eagle3_drafter(path, TARGET, target, "cpu", torch.float32)
    assert not drafter.config.has_embedding
    assert "embed_tokens.weight" not in dict(drafter.named_parameters())   # not the drafter's to load or move
    ids = torch.tensor([0, 5, 95])
    assert torch.equal(drafter.embed(ids), target.embed_tokens(ids))


def test_full_draft_vocab_needs_no_d2t(tmp_path, target):
    path, _ = write_drafter(tmp_path / "d", draft_vocab=TARGET.vocab_size)
    drafter = load_eagle3_drafter(path, TARGET, target, "cpu", torch.float32)
    ids = torch.tensor([0, 50, 95])
    assert torch.equal(drafter.draft_to_target(ids), ids) and bool(drafter.t2d.all())


def test_default_aux_layers_are_early_middle_late(tmp_path, target):
    path, _ = write_drafter(tmp_path / "d", eagle_config=None)
    drafter = load_eagle3_drafter(path, TARGET, target, "cpu", torch.float32)
    assert drafter.config.aux_layer_ids == (2, 3, 3)   # (2, L // 2, L - 3) for L = 6


def test_aux_layer_ids_may_sit_at_the_top_level(tmp_path, target):
    path, _ = write_drafter(tmp_path / "d", eagle_config=None, eagle_aux_hidden_state_layer_ids=[0, 2, 5])
    drafter = load_eagle3_drafter(path, TARGET, target, "cpu", torch.float32)
    assert drafter.config.aux_layer_ids == (0, 2, 5)


BAD_DRAFTERS = {
    "wrong architecture": (dict(architectures=["LlamaForCausalLM"]), "not an EAGLE-3 drafter"),
    "vocab differs from the target": (dict(vocab_size=97), "differs from the target model's vocabulary"),
    "missing d2t": (dict(drop=("d2t", "t2d")), "lacks the 'd2t' tensor"),
    "d2t wrong shape": (dict(replace={"d2t": torch.zeros(39, dtype=torch.int64)}), "d2t has shape [39]"),
    "d2t outside the vocab": (dict(replace={"d2t": torch.full((40,), 60, dtype=torch.int64)}),
                              "outside the target vocabulary"),
    "t2d inconsistent": (dict(replace={"t2d": torch.ones(96, dtype=torch.bool)}), "t2d"),
    "aux layer out of range": (dict(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 7]}),
                               "must be exactly 3 target layer ids in 0..6"),
    "two aux layers": (dict(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3]}), "exactly 3"),
    "fc shape": (dict(replace={"fc.weight": torch.zeros(32, 3 * 40)}), "fc.weight has shape [32, 120]"),
    "target hidden differs": (dict(target_hidden=40, target_hidden_size=40),
                              "target_hidden_size 40 differs from the target model's hidden_size (48)"),
    "missing tensors": (dict(drop=("midlayer.hidden_norm.weight", "norm.weight")),
                        "lacks tensor(s): norm.weight, midlayer.hidden_norm.weight"),
    "no embedding, target too wide": (dict(embed=False), "embedding dim (48) differs from the drafter's hidden"),
    "wrong tensor shape": (dict(replace={"lm_head.weight": torch.zeros(41, 32)}), "lm_head.weight"),
}


@pytest.mark.parametrize("case", BAD_DRAFTERS)
def test_a_bad_drafter_is_one_clear_error(tmp_path, target, case):
    kwargs, phrase = BAD_DRAFTERS[case]
    path, _ = write_drafter(tmp_path / "bad", **kwargs)
    with pytest.raises(KestrelError) as err:
        load_eagle3_drafter(path, TARGET, target, "cpu", torch.float32)
    assert phrase in str(err.value)
    assert str(path) in str(err.value)   # names the file (or the directory) at fault


@pytest.mark.parametrize("with_embedding", [False, True])
def test_random_checkpoint_loads_and_runs(tmp_path, target, with_embedding):
    path = random_eagle3_checkpoint(tmp_path / "r", TARGET, hidden_size=32 if with_embedding else None,
                                    draft_vocab_size=40, dtype=torch.float32, with_embedding=with_embedding,
                                    random_vocab_subset=True, num_attention_heads=HEADS, head_dim=HEAD_DIM,
                                    num_key_value_heads=KV_HEADS)
    drafter = load_eagle3_drafter(path, TARGET, target, "cpu", torch.float32)
    assert drafter.config.draft_vocab_size == 40 and drafter.config.has_embedding == with_embedding
    target_ids = drafter.draft_to_target(torch.arange(40))
    assert bool((target_ids[1:] > target_ids[:-1]).all()) and int(drafter.t2d.sum()) == 40
    cache = torch.zeros(drafter.kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE))
    batch = build_forward_batch([[1, 2, 3], [4]], [0, 0], [[0], [1]], BLOCK_SIZE)
    normed, out = drafter(batch, torch.randn(4, 3 * 48), TorchAttentionBackend(), (cache[0], cache[1]))
    assert out.shape == (4, drafter.config.hidden_size) and bool(drafter.compute_logits(normed).isfinite().all())


def test_a_yarn_drafter_rotates_as_its_config_says(tmp_path, target):
    """YaRN rope scaling (a long-context target's drafter): the table is YaRN's, original_max_position_embeddings
    taken from the config's max_position_embeddings when the scaling does not name it, as a target's config."""
    from kestrel.layers.rotary import RotaryEmbedding

    yarn = {"rope_type": "yarn", "factor": 4.0}
    path, _ = write_drafter(tmp_path / "yarn", rope_scaling=yarn)
    drafter = load_eagle3_drafter(path, TARGET, target, "cpu", torch.float32)
    assert drafter.config.rope_scaling == dict(yarn, original_max_position_embeddings=128)
    want = RotaryEmbedding(HEAD_DIM, 128, THETA, dict(yarn, original_max_position_embeddings=128)).cos_sin_cache
    plain = RotaryEmbedding(HEAD_DIM, 128, THETA, None).cos_sin_cache
    got = drafter.midlayer.self_attn.rotary.cos_sin_cache
    assert torch.allclose(got, want.to(got.dtype)) and not torch.allclose(got, plain.to(got.dtype))
    path, _ = write_drafter(tmp_path / "dynamic", rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(KestrelError, match="rope scaling type 'dynamic' is not supported"):
        load_eagle3_drafter(path, TARGET, target, "cpu", torch.float32)
