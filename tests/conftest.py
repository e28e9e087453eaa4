"""Shared fixtures: tiny random-weight HF checkpoints of every supported architecture, made at test time."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tiny test models gain nothing from intra-op threads, and on a 2-core machine a server subprocess plus the test
# process each spinning 2 OpenMP threads oversubscribe the cores (seen: 5x slower runs). Subprocesses inherit this.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# tests/gpu runs on a CUDA machine; CPU machines skip it.
collect_ignore = [] if _has_cuda() else ["gpu"]

ARCH_OVERRIDES = {
    "llama": dict(),
    "llama3": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen2": dict(),
    "qwen3": dict(),
    "mistral": dict(sliding_window=None),
}
MODEL_TYPE = {"llama": "llama", "llama3": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "mistral"}


def make_checkpoint(out: Path, arch: str = "llama", tie: bool = False, shard: bool = False, seed: int = 0,
                    num_kv_heads: int = 2, vocab_size: int | None = None, head_dim: int = 16,
                    hidden_size: int = 64, intermediate_size: int = 128, max_position_embeddings: int = 256,
                    num_heads: int = 4) -> Path:
    """Random-weight checkpoint + the default model's tokenizer (so prompts are real text)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = make_tokenizer()
    vocab = vocab_size or len(tokenizer)
    kwargs = dict(hidden_size=hidden_size, intermediate_size=intermediate_size, num_hidden_layers=2,
                  num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, head_dim=head_dim, vocab_size=vocab,
                  max_position_embeddings=max_position_embeddings, tie_word_embeddings=tie, rms_norm_eps=1e-5,
                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    if arch == "qwen2":
        kwargs.pop("head_dim")
    kwargs.update(ARCH_OVERRIDES[arch])
    config = AutoConfig.for_model(MODEL_TYPE[arch], **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # HF inits some weights to 1/0; make them random so every tensor matters
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.05 * torch.randn_like(p))
            else:
                p.copy_(0.08 * torch.randn_like(p))
    model.save_pretrained(str(out), safe_serialization=True, max_shard_size="60KB" if shard else "5GB")
    tokenizer.save_pretrained(str(out))
    return out


CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def make_tokenizer():
    """A small byte-level BPE tokenizer trained on a few stdlib files (deterministic, < 1 s)."""
    import sysconfig

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    lib = Path(sysconfig.get_paths()["stdlib"])
    text = [(lib / name).read_text() for name in ("os.py", "json/decoder.py", "functools.py")]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=384, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(text, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   chat_template=CHAT_TEMPLATE)


@pytest.fixture(autouse=True)
def _switches_from_this_tests_environment():
    """kestrel/envs.py reads the developer switches once per process; each test reads them from its own
    environment (a monkeypatched one included), and leaves none cached for the next."""
    from kestrel.envs import switches
    switches.cache_clear()
    yield
    switches.cache_clear()


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory):
    cache: dict[tuple, Path] = {}

    def make(arch: str = "llama", tie: bool = False, shard: bool = False, **kw) -> Path:
        key = (arch, tie, shard, tuple(sorted(kw.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp(f"ckpt_{arch}_{'tied' if tie else 'untied'}{'_sharded' if shard else ''}")
            cache[key] = make_checkpoint(out, arch, tie, shard, **kw)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def moe_checkpoint(tmp_path_factory):
    """name -> a tiny HF MoE / MLA checkpoint of tests/test_moe_models.py's CONFIGS (written once a session: the
    MoE model tests and the tensor-parallel tests share them)."""
    from tests.test_moe_models import make_moe_checkpoint   # transformers' models: imported only when asked

    cache: dict[str, Path] = {}

    def make(name: str) -> Path:
        if name not in cache:
            cache[name] = make_moe_checkpoint(tmp_path_factory.mktemp(f"ckpt_{name}"), name)
        return cache[name]

    return make


@pytest.fixture(autouse=True)
def fresh_dev_switches():
    """kestrel.envs reads the developer switches once per process; a test that sets one (monkeypatch.setenv)
    must not leave its reading to the next test."""
    from kestrel.envs import switches

    switches.cache_clear()
    yield
    switches.cache_clear()
