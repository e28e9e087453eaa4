"""DeepSeek-V3's multi-token-prediction layer as a drafter (method deepseek_mtp, SGLang's NEXTN), float32 on the
CPU, on a tiny random DeepSeek-V3 checkpoint (tests/test_moe_models.py) given an MTP layer: config.json's
num_nextn_predict_layers 1 and tensors model.layers.3.* (3 = num_hidden_layers) in a second weight file.

- the layer's forward equals a torch reference written from DeepSeek-V3's report (transformers has no MTP module;
  the decoder block inside it is transformers' own DeepseekV3DecoderLayer), extend rows and a fed-back step
- greedy output with it, chain and tree, is token-identical to the same engine without speculation
- made an oracle (a target whose layers add nothing predicts the next token from the current one alone; an MTP
  layer that passes its token's embedding through predicts the token after it), every draft is accepted
- its tensors are found by name, and a wrong-shaped, missing or absent layer is one clear error
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kestrel import LLM, SamplingParams
from kestrel.batch import build_forward_batch
from kestrel.errors import KestrelError, ModelLoadError
from kestrel.models.checkpoint import load_model_config, load_weights
from kestrel.models.deepseek_v3 import DeepseekV3ForCausalLM
from kestrel.models.mtp_loader import check_mtp_target, load_mtp_drafter
from kestrel.speculative_config import parse_speculative_json
from tests.test_eagle3_drafter import TARGET as LLAMA
from tests.test_moe_models import PROMPTS, hf_model
from tests.test_spec_config import cli

K = 3
LAYER = 3   # the tiny DeepSeek-V3's num_hidden_layers: its MTP layer is model.layers.3
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def mtp_tensors(target_dir: Path, seed: int = 0) -> dict[str, torch.Tensor]:
    """A random MTP layer for the checkpoint, named as DeepSeek-V3's released one: the block of a MoE decoder layer
    (transformers' own, so its names are the checkpoint's), enorm / hnorm / eh_proj / shared_head.norm, and the
    copies of the target's embedding and lm_head that released checkpoints carry."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(target_dir))
    torch.manual_seed(seed)
    block = decoder_layer_class(config.model_type)(config, LAYER)
    h = config.hidden_size
    tensors = {}
    for name, t in block.state_dict().items():
        if "norm" in name:
            t = 1.0 + 0.1 * torch.randn_like(t)
        elif name.endswith("e_score_correction_bias"):
            t = 0.05 * torch.randn_like(t)
        else:
            t = 0.08 * torch.randn_like(t)
        if name == "mlp.experts.gate_up_proj":   # transformers stacks the experts; checkpoints keep one each
            for e, (gate, up) in enumerate(x.chunk(2, dim=0) for x in t.unbind(0)):
                tensors[f"mlp.experts.{e}.gate_proj.weight"], tensors[f"mlp.experts.{e}.up_proj.weight"] = gate, up
        elif name == "mlp.experts.down_proj":
            tensors |= {f"mlp.experts.{e}.down_proj.weight": down for e, down in enumerate(t.unbind(0))}
        else:
            tensors[name] = t
    tensors |= {"enorm.weight": 1.0 + 0.1 * torch.randn(h), "hnorm.weight": 1.0 + 0.1 * torch.randn(h),
                "eh_proj.weight": 0.08 * torch.randn(h, 2 * h), "shared_head.norm.weight": 1.0 + 0.1 * torch.randn(h)}
    target = load_file(str(target_dir / "model.safetensors"))
    tensors |= {"embed_tokens.weight": target["model.embed_tokens.weight"],
                "shared_head.head.weight": target["lm_head.weight"]}
    return tensors


def decoder_layer_class(model_type: str) -> type:
    """transformers' decoder layer of the family: the MTP block is one of the target's own kind."""
    if model_type == "glm4_moe":
        from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeDecoderLayer
        return Glm4MoeDecoderLayer
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer
    return DeepseekV3DecoderLayer


def with_mtp_layer(target_dir: Path, out: Path, tensors: dict[str, torch.Tensor], layers: int | None = 1) -> Path:
    """A copy of the checkpoint with `tensors` as its model.layers.3.* and num_nextn_predict_layers `layers`."""
    shutil.copytree(target_dir, out)
    raw = json.loads((out / "config.json").read_text())
    raw.pop("num_nextn_predict_layers", None)
    if layers is not None:
        raw["num_nextn_predict_layers"] = layers
    (out / "config.json").write_text(json.dumps(raw))
    save_file({f"model.layers.{LAYER}.{k}": v.contiguous() for k, v in tensors.items()}, str(out / "mtp.safetensors"))
    return out


@pytest.fixture(scope="module")
def mtp_checkpoints(moe_checkpoint, tmp_path_factory):
    """family -> its tiny checkpoint with a random MTP layer, made once per module."""
    made: dict[str, Path] = {}

    def make(name: str) -> Path:
        if name not in made:
            target = moe_checkpoint(name)
            made[name] = with_mtp_layer(target, tmp_path_factory.mktemp(f"mtp_{name}") / "ckpt", mtp_tensors(target))
        return made[name]

    return make


@pytest.fixture(scope="module")
def mtp_checkpoint(mtp_checkpoints) -> Path:
    return mtp_checkpoints("deepseek_v3")


def mtp(topk: int = 1) -> dict:
    return {"method": "deepseek_mtp", "num_speculative_tokens": K, "topk": topk, "adaptive": False}


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def hf_block_state(w: dict[str, torch.Tensor], num_experts: int) -> dict[str, torch.Tensor]:
    """The MTP block's checkpoint tensors as transformers' DeepseekV3DecoderLayer holds them (experts stacked)."""
    state = {k: v for k, v in w.items() if k.startswith(("self_attn.", "mlp.", "input_layernorm.",
                                                          "post_attention_layernorm.")) and ".experts." not in k}
    experts = range(num_experts)
    state["mlp.experts.gate_up_proj"] = torch.stack([
        torch.cat([w[f"mlp.experts.{e}.gate_proj.weight"], w[f"mlp.experts.{e}.up_proj.weight"]]) for e in experts])
    state["mlp.experts.down_proj"] = torch.stack([w[f"mlp.experts.{e}.down_proj.weight"] for e in experts])
    return state


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def reference_mtp(hf, block, w: dict[str, torch.Tensor], tokens: list[int], hidden: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3 Technical Report (arXiv:2412.19437), section 2.2, eqs. 21-23, for the first MTP module: row i
    combines the representation h_i with the embedding of token t_{i+1} (here tokens[i]) through RMSNorm each and
    the projection M (eh_proj; the released weights read [embedding | hidden]), runs the Transformer block causally
    over the rows, and the shared output head gives the distribution of t_{i+2}. Emb and OutHead are the main
    model's. Returns the normed outputs [T, H] (logits: hf.lm_head of them)."""
    eps = hf.config.rms_norm_eps
    emb = hf.model.embed_tokens(torch.tensor(tokens))
    x = torch.cat([rms_norm(emb, w["enorm.weight"], eps), rms_norm(hidden, w["hnorm.weight"], eps)], dim=-1)
    x = (x @ w["eh_proj.weight"].T)[None]
    n = x.shape[1]
    positions = torch.arange(n)[None]
    mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
    out = block(x, attention_mask=mask, position_ids=positions, position_embeddings=hf.model.rotary_emb(x, positions))
    return rms_norm(out[0], w["shared_head.norm.weight"], eps)


@torch.no_grad()
@pytest.mark.parametrize("name", ["deepseek_v3", pytest.param("glm4_moe", marks=pytest.mark.slow)])
def test_mtp_layer_forward_matches_a_reference_written_from_the_report(mtp_checkpoints, moe_checkpoint, name):
    """Extend rows 0 .. n-2 (the target's normed state at i with token i + 1), then one draft step fed its own
    output at n - 2 with a drafted token, through the paged cache (DeepSeek-V3's latent one; GLM-4.5's K/V);
    against the dense reference."""
    mtp_checkpoint = mtp_checkpoints(name)
    llm = LLM(model=str(mtp_checkpoint), device="cpu", block_size=4, speculative_config=mtp())
    engine = llm.engine
    assert engine.runner.capture_hidden_layers == (LAYER,)
    proposer = engine.spec.proposer
    drafter = proposer.drafter
    ids = llm.tokenizer.encode(PROMPTS[0])[:20]
    n = len(ids)
    table = engine.pool.allocate(-(-(n + 1) // engine.pool.block_size))
    batch = build_forward_batch([ids], [0], [table], engine.pool.block_size, capture_hidden_layers=(LAYER,))
    aux = engine.runner.forward(batch).hidden_states[LAYER]
    extend = build_forward_batch([ids[1:]], [0], [table], engine.pool.block_size)
    proposer.backend.prepare(extend)
    _, out = drafter(extend, drafter.from_target(aux[:n - 1]), proposer.backend, proposer.kv)
    drafted = int(drafter.compute_logits(out[-1:]).argmax())
    step = build_forward_batch([[drafted]], [n - 1], [table], engine.pool.block_size)
    proposer.backend.prepare(step)
    _, fed = drafter(step, out[-1:], proposer.backend, proposer.kv)
    engine.pool.release(table)

    hf = hf_model(moe_checkpoint(name))
    w = load_file(str(mtp_checkpoint / "mtp.safetensors"))
    w = {k.removeprefix(f"model.layers.{LAYER}."): v for k, v in w.items()}
    block = decoder_layer_class(hf.config.model_type)(hf.config, LAYER).eval()
    block.load_state_dict(hf_block_state(w, hf.config.n_routed_experts))
    h = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]   # after the final norm
    want = reference_mtp(hf, block, w, ids[1:], h[:n - 1])
    assert (out - want).norm() / want.norm() < 1e-5
    want_logits = hf.lm_head(want[-1:])
    assert int(want_logits.argmax()) == drafted
    assert torch.allclose(drafter.compute_logits(out[-1:]), want_logits, atol=1e-4)
    # the fed-back step: row n - 1 reads the module's own normed output at n - 2 and the drafted token
    want_fed = reference_mtp(hf, block, w, ids[1:] + [drafted], torch.cat([h[:n - 1], want[-1:]]))[-1:]
    assert (fed - want_fed).norm() / want_fed.norm() < 1e-5


GREEDY_CASES = [pytest.param("deepseek_v3", 1, id="deepseek_v3-chain"),
                pytest.param("deepseek_v3", 3, id="deepseek_v3-tree", marks=pytest.mark.slow),
                pytest.param("glm4_moe", 1, id="glm4_moe-chain", marks=pytest.mark.slow)]


@pytest.mark.parametrize("name,topk", GREEDY_CASES)
def test_greedy_with_mtp_is_token_identical_to_no_speculation(mtp_checkpoints, name, topk):
    mtp_checkpoint = mtp_checkpoints(name)
    want = token_ids(LLM(model=str(mtp_checkpoint), device="cpu").generate(PROMPTS, GREEDY))
    llm = LLM(model=str(mtp_checkpoint), device="cpu", speculative_config=mtp(topk))
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == want
    c = llm.engine.spec.counters
    assert c.num_drafts > 0 and c.num_draft_tokens > 0, c


@pytest.mark.slow
def test_an_oracle_mtp_layer_has_every_draft_accepted(moe_checkpoint, tmp_path):
    """A target whose attention and MLP outputs are zero predicts from the current token alone: next = g(t) =
    argmax lm_head(norm(Emb(t))). An MTP layer whose block adds nothing, whose eh_proj passes the normed embedding
    of t_{i+1} through and whose shared_head.norm is the target's final norm predicts g(t_{i+1}) = t_{i+2}, the
    target's own next token, at the extend and at every fed-back step: each draft is accepted, and only if the
    drafter reads the right token at the right row (the shift by one, the drafted tokens fed back)."""
    source = moe_checkpoint("deepseek_v3")
    silent = tmp_path / "silent"
    shutil.copytree(source, silent)
    weights = load_file(str(source / "model.safetensors"))
    silence = ("o_proj.weight", "down_proj.weight")
    weights = {k: torch.zeros_like(v) if k.endswith(silence) else v for k, v in weights.items()}
    save_file(weights, str(silent / "model.safetensors"))
    tensors = mtp_tensors(source, seed=3)
    tensors = {k: torch.zeros_like(v) if k.endswith(silence) else v for k, v in tensors.items()}
    h = tensors["enorm.weight"].shape[0]
    tensors["enorm.weight"] = torch.ones(h)
    tensors["eh_proj.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
    tensors["shared_head.norm.weight"] = weights["model.norm.weight"]
    oracle = with_mtp_layer(silent, tmp_path / "oracle", tensors)

    params = SamplingParams(max_tokens=1 + 4 * (K + 1), temperature=0, ignore_eos=True)
    want = token_ids(LLM(model=str(oracle), device="cpu").generate(PROMPTS, params))
    llm = LLM(model=str(oracle), device="cpu", block_size=4, speculative_config=mtp())
    assert token_ids(llm.generate(PROMPTS, params)) == want
    c = llm.engine.spec.counters
    assert c.num_drafts > 0 and c.accepted_per_pos == [c.num_drafts] * K, c


def load_target(path: Path) -> DeepseekV3ForCausalLM:
    model = DeepseekV3ForCausalLM(load_model_config(path))
    load_weights(model, path)
    return model.eval()


def test_loading_puts_each_tensor_of_the_layer_in_its_place(mtp_checkpoint):
    target = load_target(mtp_checkpoint)
    drafter = load_mtp_drafter(mtp_checkpoint, target, "cpu", torch.float32)
    w = load_file(str(mtp_checkpoint / "mtp.safetensors"))
    w = {k.removeprefix(f"model.layers.{LAYER}."): v for k, v in w.items()}
    assert torch.equal(drafter.eh_proj.weight, w["eh_proj.weight"])
    assert torch.equal(drafter.enorm.weight, w["enorm.weight"]) and torch.equal(drafter.hnorm.weight, w["hnorm.weight"])
    assert torch.equal(drafter.shared_head.norm.weight, w["shared_head.norm.weight"])
    attn, moe = drafter.block.self_attn, drafter.block.mlp
    assert torch.equal(attn.kv_b_proj.weight, w["self_attn.kv_b_proj.weight"])
    assert torch.equal(attn.q_a_proj.weight, w["self_attn.q_a_proj.weight"])
    assert torch.equal(drafter.block.input_layernorm.weight, w["input_layernorm.weight"])
    gate_up = moe.shared_experts.gate_up_proj.weight
    shared = [w[f"mlp.shared_experts.{part}_proj.weight"] for part in ("gate", "up")]
    assert torch.equal(gate_up, torch.cat(shared))
    # the shared embedding and output head are the target's, not copies
    assert drafter.embed(torch.tensor([5])).data_ptr() != 0 and drafter._shared[0] is target.embed_tokens
    assert drafter._shared[1] is target.lm_head.weight
    # one latent plane of one layer, in the target's blocks
    cfg = target.config
    assert drafter.kv_cache_shape(10, 4) == (1, 10, 4, 1, cfg.kv_lora_rank + cfg.qk_rope_head_dim)


def test_a_wrong_shaped_or_missing_tensor_names_the_layer_and_the_tensor(mtp_checkpoint, moe_checkpoint, tmp_path):
    source = moe_checkpoint("deepseek_v3")
    target = load_target(source)
    tensors = mtp_tensors(source)
    h = tensors["eh_proj.weight"].shape[0]
    wrong = with_mtp_layer(source, tmp_path / "wrong", tensors | {"eh_proj.weight": torch.zeros(h, h)})
    with pytest.raises(ModelLoadError, match=rf"model.layers.{LAYER}.*eh_proj.*{h}"):
        load_mtp_drafter(wrong, target, "cpu", torch.float32)
    missing = with_mtp_layer(source, tmp_path / "missing", {k: v for k, v in tensors.items() if k != "hnorm.weight"})
    with pytest.raises(ModelLoadError, match=r"lacks tensor\(s\): hnorm.weight"):
        load_mtp_drafter(missing, target, "cpu", torch.float32)
    absent = with_mtp_layer(source, tmp_path / "absent", {}, layers=None)
    with pytest.raises(KestrelError, match="carries no multi-token-prediction layer"):
        LLM(model=str(absent), device="cpu", speculative_config=mtp())
    no_file = with_mtp_layer(source, tmp_path / "no_file", {}, layers=1)
    with pytest.raises(ModelLoadError, match=rf"no weight file holds model.layers.{LAYER}"):
        load_mtp_drafter(no_file, target, "cpu", torch.float32)


def test_the_method_is_named_as_vllm_and_sglang_name_it():
    """The flags of `kestrel serve`: vLLM's JSON (deepseek_mtp, or its umbrella name mtp), SGLang's NEXTN."""
    vllm = cli("--speculative-config", '{"method": "deepseek_mtp", "num_speculative_tokens": 2}').speculative
    assert (vllm.method, vllm.model, vllm.num_speculative_tokens) == ("deepseek_mtp", None, 2)
    assert parse_speculative_json('{"method": "mtp"}').method == "deepseek_mtp"
    sglang = cli("--speculative-algorithm", "NEXTN", "--speculative-num-steps", "2").speculative
    assert sglang == vllm
    with pytest.raises(KestrelError, match="takes no model"):
        parse_speculative_json({"method": "deepseek_mtp", "model": "/some/dir"})
    with pytest.raises(KestrelError, match="deepseek_mtp needs a target with a multi-token-prediction layer"):
        check_mtp_target(LLAMA, Path("llama"))


@pytest.mark.slow
def test_chunked_prefill_prefix_cache_and_preemption_keep_the_tokens(mtp_checkpoint):
    """16-token steps, 4-token blocks and 48 of them for 8 sequences: prompts prefilled in chunks, prefix hits the
    drafter never computed (gaps in its cache: lower acceptance, never other tokens), sequences preempted."""
    prompts = PROMPTS * 2
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    kw = dict(device="cpu", block_size=4, max_num_batched_tokens=16, num_gpu_blocks_override=40)
    want = token_ids(LLM(model=str(mtp_checkpoint), **kw).generate(prompts, params))
    llm = LLM(model=str(mtp_checkpoint), speculative_config=mtp(), **kw)
    for _ in range(2):
        assert token_ids(llm.generate(prompts, params)) == want
    assert llm.engine.scheduler.num_preemptions > 0, "the cache was meant to force preemption"
    assert llm.engine.prefix_cache.stats.hit_tokens > 0 and llm.engine.spec.counters.num_drafts > 0


@pytest.mark.slow
@pytest.mark.parametrize("topk", [1, 3])
def test_mtp_at_tp2_gives_one_ranks_tokens(mtp_checkpoint, topk):
    """The target's heads and experts split over two ranks; the MTP layer whole on rank 0, the embedding and
    lm_head it shares gathered whole there."""
    want = token_ids(LLM(model=str(mtp_checkpoint), device="cpu").generate(PROMPTS, GREEDY))
    llm = LLM(model=str(mtp_checkpoint), device="cpu", tensor_parallel_size=2, speculative_config=mtp(topk))
    try:
        assert token_ids(llm.generate(PROMPTS, GREEDY)) == want
        assert llm.engine.spec.counters.num_drafts > 0
    finally:
        llm.shutdown()


def test_dummy_weights_draft_from_a_config_alone(moe_checkpoint, tmp_path):
    """--load-format dummy (GPU benchmarks of DeepSeek-V3's shape from its config.json): the MTP layer gets random
    weights too, after the target's, so the target is the same as without speculation."""
    source = moe_checkpoint("deepseek_v3")
    config_only = tmp_path / "config_only"
    config_only.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        if (source / name).is_file():
            shutil.copy(source / name, config_only / name)
    raw = json.loads((config_only / "config.json").read_text())
    (config_only / "config.json").write_text(json.dumps(raw | {"num_nextn_predict_layers": 1}))
    kw = dict(model=str(config_only), device="cpu", load_format="dummy")
    want = token_ids(LLM(**kw).generate(PROMPTS[2:], GREEDY))
    llm = LLM(**kw, speculative_config=mtp())
    assert token_ids(llm.generate(PROMPTS[2:], GREEDY)) == want
    assert llm.engine.spec.counters.num_drafts > 0
