"""EAGLE-3 on mixture-of-experts and latent-attention targets, float32 on the CPU: tiny random Qwen3-MoE, Mixtral,
GLM-4-MoE and DeepSeek-V3 checkpoints (tests/test_moe_models.py writes them with HF's save_pretrained), each with a
random drafter of the standard shape for it (models/eagle3_loader.py: a Llama layer; for DeepSeek's latent
attention the target's heads at v_head_dim wide).

- the hidden states the drafter reads come out of each model's own layer stack, and are HF's (the inputs of the aux
  layers: past a MoE layer, past latent attention)
- greedy output with EAGLE-3, chain and tree, is token-identical to the same engine without speculation
- DeepSeek-V3's latent cache under speculation: whole chains accepted, a tree runner-up accepted and its latent
  entry moved next to the root, rejected positions rewritten before any step reads them (the output stays HF's
  only if no stale entry is ever attended), with chunked prefill, the prefix cache and preemption
- sampled output keeps the target's distribution (Qwen3-MoE, DeepSeek-V3)
- tensor parallelism: DeepSeek-V3 and Qwen3-MoE with EAGLE-3 at TP=2 give one rank's tokens
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from kestrel import LLM, SamplingParams
from kestrel.batch import build_forward_batch
from kestrel.models.checkpoint import load_model_config
from kestrel.models.eagle3_loader import random_eagle3_checkpoint
from tests.test_moe_models import PROMPTS, hf_model
from tests.test_spec_tree import RunnerUpOracle
from tests.test_speculative import OracleProposer, bucketed_tv, chi_squared_p_value

K = 3
TOPK = 3
FAMILIES = ["qwen3_moe", "mixtral", "glm4_moe", "deepseek_v3"]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def target_and_drafter(moe_checkpoint, tmp_path_factory):
    """name -> (target checkpoint, a random EAGLE-3 drafter for it), made once per module."""
    made: dict[str, tuple[Path, Path]] = {}

    def make(name: str) -> tuple[Path, Path]:
        if name not in made:
            target = moe_checkpoint(name)
            drafter = random_eagle3_checkpoint(tmp_path_factory.mktemp(f"drafter_{name}"), load_model_config(target),
                                               draft_vocab_size=256, seed=1, dtype=torch.float32,
                                               random_vocab_subset=True)
            made[name] = (target, drafter)
        return made[name]

    return make


def eagle3(drafter: Path, topk: int = 1) -> dict:
    return {"method": "eagle3", "model": str(drafter), "num_speculative_tokens": K, "topk": topk, "adaptive": False}


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_the_drafter_of_a_latent_attention_target_is_a_llama_layer_of_its_heads(target_and_drafter):
    import json

    target, drafter = target_and_drafter("deepseek_v3")
    raw = json.loads((drafter / "config.json").read_text())
    cfg = load_model_config(target)
    assert (raw["num_attention_heads"], raw["num_key_value_heads"], raw["head_dim"]) == (4, 4, cfg.v_head_dim)
    assert raw["hidden_size"] == raw["target_hidden_size"] == cfg.hidden_size and raw["rope_scaling"] is None


@pytest.mark.parametrize("name", FAMILIES)
def test_aux_hidden_states_are_the_inputs_of_the_target_layers_as_hf_computes_them(target_and_drafter, name):
    """Layer 0's input (the embedding), then the stream entering layers 1 and 2: past a dense or MoE layer, Llama
    or latent attention. What every model's forward returns for capture_hidden_layers (models/llama.py)."""
    target, drafter = target_and_drafter(name)
    llm = LLM(model=str(target), device="cpu", speculative_config=eagle3(drafter))
    engine = llm.engine
    assert engine.runner.capture_hidden_layers == (2, 1, 0)   # default_aux_layer_ids(3): (2, L // 2, L - 3)
    ids = llm.tokenizer.encode(PROMPTS[0])
    table = engine.pool.allocate(-(-len(ids) // engine.pool.block_size))
    batch = build_forward_batch([ids], [0], [table], engine.pool.block_size, capture_hidden_layers=(0, 1, 2))
    captured = engine.runner.forward(batch).hidden_states
    engine.pool.release(table)
    with torch.no_grad():
        ref = hf_model(target)(torch.tensor([ids]), output_hidden_states=True).hidden_states
    for layer in (0, 1, 2):
        got, want = captured[layer], ref[layer][0]
        assert got.shape == want.shape
        assert (got - want).norm() / want.norm() < 1e-5, f"layer {layer}"


# the quick tier keeps one (the latent cache under a tree); the others take a few seconds each
GREEDY_CASES = [pytest.param(name, topk, id=f"{name}-{'chain' if topk == 1 else 'tree'}",
                             marks=() if (name, topk) == ("deepseek_v3", TOPK) else pytest.mark.slow)
                for name in FAMILIES for topk in (1, TOPK)]


@pytest.mark.parametrize("name,topk", GREEDY_CASES)
def test_greedy_with_eagle3_is_token_identical_to_no_speculation(target_and_drafter, name, topk):
    target, drafter = target_and_drafter(name)
    want = token_ids(LLM(model=str(target), device="cpu").generate(PROMPTS, GREEDY))
    llm = LLM(model=str(target), device="cpu", speculative_config=eagle3(drafter, topk))
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == want
    c = llm.engine.spec.counters
    assert c.num_drafts > 0 and c.num_draft_tokens > 0, c


@pytest.mark.slow
@pytest.mark.parametrize("case", ["chain", "runner-up"])
def test_accepted_drafts_over_the_latent_cache_keep_the_tokens(target_and_drafter, case):
    """An oracle in the drafter's place (the target's own continuation): chain, every draft accepted, so verify
    steps write K + 1 latent entries that all stay; runner-up, the true token at rank 1 of a tree's steps, so one
    draft a step is accepted and its latent entry moved from cache index start + 2 to start + 1, and the other
    nodes' entries are left behind to be rewritten. Both with 4-token blocks (moves and drafts cross blocks)."""
    target, drafter = target_and_drafter("deepseek_v3")
    params = SamplingParams(max_tokens=1 + 5 * (K + 1), temperature=0, ignore_eos=True)
    plain = LLM(model=str(target), device="cpu", block_size=4).generate(PROMPTS, params)
    sequences = [o.prompt_token_ids + o.outputs[0].token_ids for o in plain]
    llm = LLM(model=str(target), device="cpu", block_size=4,
              speculative_config=eagle3(drafter, 1 if case == "chain" else TOPK))
    vocab = llm.engine.model_config.vocab_size
    llm.engine.spec.proposer = OracleProposer(sequences) if case == "chain" else RunnerUpOracle(sequences, 1, vocab)
    assert token_ids(llm.generate(PROMPTS, params)) == token_ids(plain)
    c = llm.engine.spec.counters
    want = [c.num_drafts] * K if case == "chain" else [c.num_drafts] + [0] * (K - 1)
    assert c.num_drafts > 0 and c.accepted_per_pos == want, c


@pytest.mark.slow
@pytest.mark.parametrize("name,topk", [("deepseek_v3", 1), ("deepseek_v3", TOPK), ("qwen3_moe", TOPK)])
def test_chunked_prefill_prefix_cache_and_preemption(target_and_drafter, name, topk):
    target, drafter = target_and_drafter(name)
    prompts = PROMPTS * 2
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    kw = dict(device="cpu", block_size=4, max_num_batched_tokens=16, num_gpu_blocks_override=40)
    want = token_ids(LLM(model=str(target), **kw).generate(prompts, params))
    llm = LLM(model=str(target), speculative_config=eagle3(drafter, topk), **kw)
    for _ in range(2):
        assert token_ids(llm.generate(prompts, params)) == want
    assert llm.engine.scheduler.num_preemptions > 0, "the cache was meant to force preemption"
    assert llm.engine.prefix_cache.stats.hit_tokens > 0
    assert llm.engine.spec.counters.num_drafts > 0


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3"])
def test_sampling_with_eagle3_keeps_the_target_distribution(target_and_drafter, name):
    TEMPERATURE = 1.0
    """2,000 samples of the first 3 tokens at temperature TEMPERATURE, with and without EAGLE-3: each position passes
    a chi-squared homogeneity test at p > 0.001 and its bucketed total variation stays under 0.08. At 0.5 the random
    Qwen3-MoE target is peaked; 1.0 gives the verifier's acceptance a chance (DeepSeek-V3's drafts are accepted and
    rejected both)."""
    target, drafter = target_and_drafter(name)
    prompt = PROMPTS[2]
    n = 2000

    def params(offset: int) -> list[SamplingParams]:
        return [SamplingParams(max_tokens=3, temperature=TEMPERATURE, ignore_eos=True, seed=offset + i) for i in range(n)]

    # every request in one batch: a step speculates only once nothing waits, so with a smaller batch only the last
    # one would draft (~200 one-token drafts of a random drafter: too few to be sure one is accepted)
    plain = token_ids(LLM(model=str(target), device="cpu", max_num_seqs=n).generate([prompt] * n, params(0)))
    llm = LLM(model=str(target), device="cpu", max_num_seqs=n, speculative_config=eagle3(drafter))
    spec = token_ids(llm.generate([prompt] * n, params(10_000)))
    for pos in range(3):
        a, b = Counter(t[pos] for t in plain), Counter(t[pos] for t in spec)
        assert chi_squared_p_value(a, b) > 1e-3, f"position {pos}"
        assert bucketed_tv(a, b) < 0.08, f"position {pos}"
    c = llm.engine.spec.counters
    assert c.num_draft_tokens > 0, c
    if name == "deepseek_v3":   # drafts accepted and rejected both: both branches of the verifier under the test
        assert c.num_accepted_tokens > 0, c
    # The random Qwen3-MoE drafter's ~600 one-token drafts are all rejected (seen at temperature 0.5 and 1.0): that
    # case tests the rejection branch's resampling only. Whether its drafts can never be accepted (a draft vocabulary
    # the target gives ~0 to) or something in its q is off is open (lab/NOTES.md).


@pytest.mark.slow
@pytest.mark.parametrize("name", ["deepseek_v3", "qwen3_moe"])
def test_eagle3_tree_at_tp2_gives_one_ranks_tokens(target_and_drafter, name):
    """Heads (latent attention's too) and every expert's width split over two ranks; the drafter on rank 0 alone,
    its embedding the target's table gathered whole there."""
    target, drafter = target_and_drafter(name)
    want = token_ids(LLM(model=str(target), device="cpu").generate(PROMPTS, GREEDY))
    llm = LLM(model=str(target), device="cpu", tensor_parallel_size=2, speculative_config=eagle3(drafter, TOPK))
    try:
        assert token_ids(llm.generate(PROMPTS, GREEDY)) == want
        assert llm.engine.spec.counters.num_drafts > 0
    finally:
        llm.shutdown()
