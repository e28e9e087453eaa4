"""Greedy tokens identical to HF transformers' generate, and last-token logits within 1e-4, in float32 on CPU."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from kestrel import LLM, SamplingParams
from kestrel.batch import build_forward_batch
from tests.tolerances import scaled

PROMPTS = [
    "def add(a, b):\n    return a + b\n",
    "import os",
    "class Stack:\n    def __init__(self):\n        self.items = []\n    def push(self, x):\n",
    "x = [i * i for i in range(10)]\nprint(",
]
MAX_TOKENS = 12

CASES = [
    dict(arch="llama"),
    dict(arch="llama", tie=True, shard=True),
    dict(arch="llama3"),
    dict(arch="qwen2", tie=True, num_kv_heads=4),
    dict(arch="qwen3"),
    dict(arch="mistral"),
]


def hf_greedy(model_dir, prompt_ids: list[list[int]], max_tokens: int) -> list[list[int]]:
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    outs = []
    for ids in prompt_ids:
        x = torch.tensor([ids])
        g = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens, do_sample=False,
                        eos_token_id=None, pad_token_id=0)
        outs.append(g[0, len(ids):].tolist())
    return outs


def case_id(case: dict) -> str:
    return "-".join(f"{k}={v}" for k, v in case.items())


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_greedy_tokens_match_hf(checkpoint_factory, case):
    path = checkpoint_factory(**case)
    llm = LLM(model=str(path), device="cpu")
    results = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    expected = hf_greedy(path, [r.prompt_token_ids for r in results], MAX_TOKENS)
    assert [r.outputs[0].token_ids for r in results] == expected
    assert all(r.outputs[0].finish_reason == "length" for r in results)


@pytest.mark.slow
@pytest.mark.parametrize("case", [CASES[0], CASES[4]], ids=case_id)
def test_preemption_and_chunked_prefill_keep_hf_tokens(checkpoint_factory, case):
    path = checkpoint_factory(**case)
    # 4-token blocks, 24 of them (96 tokens) for 4 sequences of up to ~50 tokens each, and a 16-token step
    # budget, so prompts are prefilled in chunks and decodes run out of blocks.
    llm = LLM(model=str(path), device="cpu", block_size=4, num_gpu_blocks_override=24,
              max_num_batched_tokens=16, disable_prefix_cache=True)
    prompts = PROMPTS * 2
    results = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    assert llm.engine.scheduler.num_preemptions > 0
    expected = hf_greedy(path, [r.prompt_token_ids for r in results], MAX_TOKENS)
    assert [r.outputs[0].token_ids for r in results] == expected
    assert llm.engine.pool.num_free == llm.engine.pool.num_blocks
    llm.engine.pool.check_invariants()


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_last_token_logits_close_to_hf(checkpoint_factory, case):
    path = checkpoint_factory(**case)
    llm = LLM(model=str(path), device="cpu")
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    engine = llm.engine
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    tables = [engine.pool.allocate(-(-len(ids) // engine.pool.block_size)) for ids in prompts]
    batch = build_forward_batch(prompts, [0] * len(prompts), tables, engine.pool.block_size)
    ours = engine.runner.forward(batch).logits
    for i, ids in enumerate(prompts):
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0, -1]
        rel = (ours[i] - ref).norm() / ref.norm()
        assert rel < 1e-4, f"prompt {i}: relative error {rel:.2e}"
    for t in tables:
        engine.pool.release(t)


def test_hidden_states_entering_chosen_layers_match_hf(checkpoint_factory):
    """EAGLE-3 reads the residual stream entering chosen layers: HF's hidden_states[i] for layer i."""
    path = checkpoint_factory("llama3")
    llm = LLM(model=str(path), device="cpu")
    engine = llm.engine
    ids = llm.tokenizer.encode(PROMPTS[2])
    blocks = engine.pool.allocate(-(-len(ids) // engine.pool.block_size))
    batch = build_forward_batch([ids], [0], [blocks], engine.pool.block_size, capture_hidden_layers=(0, 1))
    out = engine.runner.forward(batch)
    engine.pool.release(blocks)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    for layer in (0, 1):
        torch.testing.assert_close(out.hidden_states[layer], ref[layer][0],
                                   **scaled(dict(rtol=1e-4, atol=1e-5), ref[layer][0]))


def test_prompt_logits_score_every_position_like_hf(checkpoint_factory):
    path = checkpoint_factory("qwen2", tie=True, num_kv_heads=4)
    llm = LLM(model=str(path), device="cpu")
    ids = llm.tokenizer.encode(PROMPTS[0])
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(llm.engine.prompt_logits(ids), ref, **scaled(dict(rtol=1e-4, atol=1e-4), ref))
    assert llm.engine.pool.num_free == llm.engine.pool.num_blocks
