"""--kv-cache-dtype fp8: the flag, the capacity, the accuracy bounds and the checkpoint's scales (CPU, torch backend).

The bounds, stated once (docs/server.md repeats them), measured on the default model (kestrel-tiny, float32 on the
CPU) with an FP8 cache (e4m3, scales 1.0) against a float32 cache, same weights and same tokens:

    logits        per position, ||fp8 - ref||_2 / ||ref||_2 <= LOGITS_BOUND (0.15) at every position of 8 prompts
                  of ~125 tokens (measured: 0.10 at worst, 0.07 on average over the prompts' worst)
    greedy tokens the first token of all 8 prompts identical, and at least TOKEN_AGREEMENT (40%) of 8 x 32
                  greedy tokens identical position by position (measured: 8/8 and 65%; two greedy runs part
                  for good at the first near-tie, so this counts positions, not prefixes)

e4m3 keeps 3 mantissa bits to bf16's 7: each cached value is off by up to 1/16 of itself, which is the price of
twice the tokens; the scales (checkpoint's, else 1.0) only choose which range those bits cover.
"""
from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kestrel import LLM
from kestrel.batch import build_forward_batch
from kestrel.config import DEFAULT_MODEL_DIR, EngineConfig, add_engine_args
from kestrel.errors import KestrelError
from kestrel.sampling_params import SamplingParams
from tests.test_speculative import drafter_dir  # noqa: F401 - the shipped drafter, a fixture

FP8 = torch.float8_e4m3fn
LOGITS_BOUND = 0.15
TOKEN_AGREEMENT = 0.40
PROMPTS = ["The quick brown fox", "Once upon a time", "In the beginning the", "Paris is the capital of",
           "def fib(n):", "1, 2, 3, 4,", "The weather today", "My favourite food is"]


def all_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """Every position's logits for one sequence prefilled into blocks 0.. (no request is running)."""
    runner = llm.engine.runner
    table = list(range(-(-len(ids) // runner.block_size)))
    return runner.forward(build_forward_batch([ids], [0], [table], runner.block_size, all_logits=[True])).logits


def worst_relative_error(llm: LLM, ref: LLM, prompts: list[list[int]]) -> float:
    worst = 0.0
    for ids in prompts:
        got, want = all_logits(llm, ids), all_logits(ref, ids)
        worst = max(worst, ((got - want).norm(dim=-1) / want.norm(dim=-1)).max().item())
    return worst


def long_prompts(tokenizer, count: int = len(PROMPTS)) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [tokenizer.encode(p) + torch.randint(3, 1000, (120,), generator=gen).tolist() for p in PROMPTS[:count]]


@pytest.fixture(scope="module")
def fp32_ref():
    llm = LLM(kv_cache_memory=32 << 20)
    yield llm
    llm.shutdown()


# ------------------------------------------------------------------------------------------------ the flag

def test_the_flag_reaches_the_config_under_vllm_names():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    for name in ("auto", "fp8", "fp8_e4m3"):
        assert EngineConfig.from_args(parser.parse_args(["--kv-cache-dtype", name])).kv_cache_dtype == name
    assert EngineConfig.from_args(parser.parse_args([])).kv_cache_fp8 is False
    assert EngineConfig(kv_cache_dtype="fp8_e4m3").kv_cache_fp8


def test_a_bad_value_is_one_clear_error(capsys):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "int8"])
    assert "invalid choice: 'int8'" in capsys.readouterr().err
    with pytest.raises(KestrelError, match=r"--kv-cache-dtype 'fp8_e5m2' is invalid: expected auto .* fp8 or fp8_e4m3"):
        LLM(kv_cache_dtype="fp8_e5m2")
    with pytest.raises(KestrelError, match="not supported with --attention-backend flashinfer"):
        EngineConfig(kv_cache_dtype="fp8", attention_backend="flashinfer")


# ------------------------------------------------------------------------------------------------ capacity

def test_the_same_budget_holds_twice_the_blocks_of_a_bf16_cache():
    budget = 24 << 20
    bf16 = LLM(dtype="bfloat16", kv_cache_memory=budget)
    fp8 = LLM(dtype="bfloat16", kv_cache_memory=budget, kv_cache_dtype="fp8")
    try:
        assert bf16.engine.runner.kv_cache.dtype == torch.bfloat16
        assert fp8.engine.runner.kv_cache.dtype == FP8
        assert fp8.engine.pool.num_blocks == 2 * bf16.engine.pool.num_blocks
        assert fp8.engine.runner.kv_cache.nbytes == bf16.engine.runner.kv_cache.nbytes <= budget
    finally:
        bf16.shutdown()
        fp8.shutdown()


# ------------------------------------------------------------------------------------------------ accuracy

def test_torch_reference_attends_over_the_dequantized_values():
    """The oracle itself: attention over an FP8 cache with scales is attention over the float cache holding
    e4m3 * scale, and a cached value is within 1/16 of the value written (e4m3's half step)."""
    from kestrel.attention import torch_ref
    from kestrel.kernels.kv_store import dequantize, quantize, store_kv

    gen = torch.Generator().manual_seed(0)
    k, v = 3 * torch.randn(24, 2, 64, generator=gen), 3 * torch.randn(24, 2, 64, generator=gen)
    k_cache, v_cache = torch.zeros(6, 4, 2, 64, dtype=FP8), torch.zeros(6, 4, 2, 64, dtype=FP8)
    slots = torch.randperm(24, generator=gen)
    store_kv(k, v, k_cache, v_cache, slots, 0.5, 2.0)
    stored_k = dequantize(k_cache.view(-1, 2, 64)[slots], 0.5, torch.float32)
    assert ((stored_k - k).abs() <= k.abs() / 16 + 2 ** -10).all()   # normal values: 1/16; tiny ones: a step
    assert torch.equal(quantize(k, k_cache, 0.5).float() * 0.5, stored_k)
    q = torch.randn(24, 4, 64, generator=gen)
    table = torch.arange(6, dtype=torch.int32)[None]
    qsl, lens = torch.tensor([0, 24], dtype=torch.int32), torch.tensor([24], dtype=torch.int32)
    ours = torch_ref.paged_attention(q, k_cache, v_cache, table, qsl, lens, 24, 24, 0.125, k_scale=0.5, v_scale=2.0)
    plain = torch_ref.paged_attention(q, dequantize(k_cache, 0.5, torch.float32),
                                      dequantize(v_cache, 2.0, torch.float32), table, qsl, lens, 24, 24, 0.125)
    torch.testing.assert_close(ours, plain, atol=1e-5, rtol=1e-5)


def test_logits_over_an_fp8_cache_stay_within_the_stated_relative_bound(fp32_ref):
    fp8 = LLM(kv_cache_memory=32 << 20, kv_cache_dtype="fp8")
    try:
        worst = worst_relative_error(fp8, fp32_ref, long_prompts(fp32_ref.tokenizer))
    finally:
        fp8.shutdown()
    assert 0.0 < worst <= LOGITS_BOUND, f"worst per-position relative logits error {worst:.3f}"


@pytest.mark.slow   # 2 x 8 greedy runs of 32 tokens
def test_greedy_tokens_agree_at_the_stated_rate(fp32_ref):
    fp8 = LLM(kv_cache_memory=32 << 20, kv_cache_dtype="fp8")
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    try:
        ours, ref = fp8.generate(PROMPTS, params), fp32_ref.generate(PROMPTS, params)
    finally:
        fp8.shutdown()
    pairs = [(a.outputs[0].token_ids, b.outputs[0].token_ids) for a, b in zip(ours, ref)]
    assert all(a[0] == b[0] for a, b in pairs), "the first greedy token differs"
    agree = sum(x == y for a, b in pairs for x, y in zip(a, b)) / sum(len(b) for _, b in pairs)
    assert agree >= TOKEN_AGREEMENT, f"{agree:.0%} of greedy tokens agree"


# ------------------------------------------------------------------------------------------------ scales

def checkpoint_with_scales(out: Path, scales: dict[str, float]) -> Path:
    """kestrel-tiny with extra tensors {name: value} in its safetensors file (config and tokenizer copied)."""
    shutil.copytree(DEFAULT_MODEL_DIR, out)
    weights = load_file(str(out / "model.safetensors"))
    weights.update({name: torch.tensor(value, dtype=torch.float32) for name, value in scales.items()})
    save_file(weights, str(out / "model.safetensors"))
    return out


def test_checkpoint_scales_load_under_every_format_name(tmp_path, caplog):
    attn = "model.layers.{}.self_attn."
    path = checkpoint_with_scales(tmp_path / "scaled", {
        attn.format(0) + "k_scale": 0.5, attn.format(0) + "v_scale": 0.25,                  # FP8 / AutoFP8
        attn.format(1) + "k_proj.k_scale": 0.125, attn.format(1) + "v_proj.v_scale": 2.0,   # ModelOpt
        attn.format(2) + "k_proj.output_scale": 0.75, attn.format(2) + "v_proj.output_scale": 1.5,  # compressed
        attn.format(3) + "kv_scale": 0.375,                                                  # the old single one
    })
    with caplog.at_level("WARNING", logger="kestrel.loader"):
        llm = LLM(model=str(path), kv_cache_dtype="fp8", kv_cache_memory=8 << 20)
    try:
        got = [(layer.self_attn.k_scale, layer.self_attn.v_scale) for layer in llm.engine.runner.model.layers]
    finally:
        llm.shutdown()
    assert got == [(0.5, 0.25), (0.125, 2.0), (0.75, 1.5), (0.375, 0.375)] + [(1.0, 1.0)] * 4
    assert "k_scale/v_scale for 4 of 8 layers from the checkpoint; the others default to 1.0" in caplog.text
    auto = LLM(model=str(path), kv_cache_memory=8 << 20)   # a model-dtype cache loads them and ignores them
    try:
        assert auto.engine.runner.kv_cache.dtype == torch.float32
        assert auto.engine.runner.model.layers[0].self_attn.k_scale == 1.0
    finally:
        auto.shutdown()


def test_no_scales_in_the_checkpoint_says_they_default_to_one(caplog):
    with caplog.at_level("WARNING", logger="kestrel.loader"):
        llm = LLM(kv_cache_dtype="fp8", kv_cache_memory=8 << 20)
    llm.shutdown()
    assert "no k_scale/v_scale, so the scales default to 1.0" in caplog.text


def test_small_checkpoint_scales_are_applied_on_write_and_on_read(tmp_path, fp32_ref):
    """Scales of 1/30: K and V sit 30 times higher in e4m3's range (kestrel-tiny's |K| <= 12, so nothing clips).
    A scale applied on one side only would leave attention 30 times off; within the bound, both sides apply it."""
    scales = {f"model.layers.{i}.self_attn.{kind}": 1 / 30 for i in range(8) for kind in ("k_scale", "v_scale")}
    llm = LLM(model=str(checkpoint_with_scales(tmp_path / "scaled", scales)), kv_cache_dtype="fp8",
              kv_cache_memory=32 << 20)
    try:
        assert llm.engine.runner.model.layers[5].self_attn.v_scale == pytest.approx(1 / 30)
        worst = worst_relative_error(llm, fp32_ref, long_prompts(fp32_ref.tokenizer, 3))
    finally:
        llm.shutdown()
    assert worst <= LOGITS_BOUND, f"worst per-position relative logits error {worst:.3f}"


# ------------------------------------------------------------------------------------------------ MLA

@pytest.mark.slow   # a DeepSeek-V3-shaped checkpoint built by transformers
def test_latent_attention_over_an_fp8_latent_cache_stays_within_the_bound(tmp_path):
    from tests.test_moe_models import make_moe_checkpoint

    path = str(make_moe_checkpoint(tmp_path, "deepseek_v3"))
    ref = LLM(model=path, device="cpu", block_size=4)
    fp8 = LLM(model=path, device="cpu", block_size=4, kv_cache_dtype="fp8")
    try:
        cache = fp8.engine.runner.kv_cache
        assert cache.dtype == FP8 and cache.shape[1] == 1, "one FP8 latent plane a layer"
        prompts = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43], [27, 18, 28, 18, 28, 45]]
        worst = worst_relative_error(fp8, ref, prompts)   # prefill: the up-projected form
        decode = max(decode_step_error(fp8, ref, ids) for ids in prompts)   # the absorbed form
    finally:
        ref.shutdown()
        fp8.shutdown()
    assert worst <= LOGITS_BOUND, f"worst per-position relative logits error {worst:.3f} (prefill)"
    assert decode <= LOGITS_BOUND, f"relative logits error {decode:.3f} (decode)"


def decode_step_error(llm: LLM, ref: LLM, ids: list[int]) -> float:
    """Prefill ids[:-1], then decode ids[-1] over the cache, in both engines: the decode logits' relative error."""
    logits = []
    for engine in (llm, ref):
        runner = engine.engine.runner
        table = list(range(-(-len(ids) // runner.block_size)))
        runner.forward(build_forward_batch([ids[:-1]], [0], [table], runner.block_size))
        logits.append(runner.forward(build_forward_batch([ids[-1:]], [len(ids) - 1], [table],
                                                         runner.block_size)).logits)
    got, want = logits
    return ((got - want).norm(dim=-1) / want.norm(dim=-1)).max().item()


# ------------------------------------------------------------------------------------------------ speculation

def test_tree_verify_over_an_fp8_cache_moves_the_accepted_kv_bytes(drafter_dir):
    """A runner-up accepted in a tree step has its K/V moved to its path position (engine/speculation.py, as bytes
    for FP8): greedy output stays that of plain decoding over the same FP8 cache."""
    from tests.test_spec_tree import PROMPTS as SPEC_PROMPTS, K, RunnerUpOracle, greedy, token_ids, tree_config

    prompts = SPEC_PROMPTS[:4]
    params = greedy(1 + 3 * (K + 1))
    plain = LLM(device="cpu", kv_cache_dtype="fp8").generate(prompts, params)
    llm = LLM(device="cpu", kv_cache_dtype="fp8", speculative_config=tree_config(drafter_dir))
    try:
        llm.engine.spec.proposer = RunnerUpOracle([o.prompt_token_ids + o.outputs[0].token_ids for o in plain], 1,
                                                  llm.engine.model_config.vocab_size)
        assert token_ids(llm.generate(prompts, params)) == token_ids(plain)
        assert llm.engine.spec.counters.num_drafts > 0
    finally:
        llm.shutdown()
