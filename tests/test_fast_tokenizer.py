"""The transformers-free tokenizer loader (kestrel/models/fast_tokenizer.py) against AutoTokenizer.

Same ids, decodes, chat-template text, special ids and length on every tokenizer it takes; anything it cannot
reproduce exactly goes back to AutoTokenizer.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from kestrel.config import DEFAULT_MODEL_DIR
from kestrel.models.fast_tokenizer import FastTokenizer, load_tokenizer_dir
from kestrel.models.tokenizer import IncrementalDetokenizer, Tokenizer
from tests.conftest import make_tokenizer

TEXTS = ["Hello world!", "  two  spaces and\ttabs\n\nnewlines", "def f(x):\n    return x + 1", "héllo wörld ✓ 日本",
         "<s>inline special</s> text", ""]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <there> & \"you\""},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Again?"}]
# Llama-3.1-like: tojson, raise_exception, loop controls, strftime_now, a {% generation %} block.
RICH_TEMPLATE = ("{% if messages[0]['role'] != 'system' %}{{ raise_exception('system first') }}{% endif %}"
                 "{{ bos_token }}{% set d = strftime_now('%Y') %}"
                 "{% for m in messages %}{% if loop.index > 9 %}{% break %}{% endif %}"
                 "{{ m | tojson }}{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}"
                 "{% endgeneration %}{% endif %}{{ eos_token }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _save(tok, out: Path, **config_changes) -> Path:
    tok.save_pretrained(str(out))
    if config_changes:
        path = out / "tokenizer_config.json"
        config = json.loads(path.read_text())
        config.update(config_changes)
        path.write_text(json.dumps(config))
    return out


def _bpe_dir(tmp_path: Path, **config_changes) -> Path:
    return _save(make_tokenizer(), tmp_path / "bpe", **config_changes)


def _llama3_like_dir(tmp_path: Path) -> Path:
    """Added special tokens, a post-processor that writes BOS, clean_up_tokenization_spaces (BPE: ignored)."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    base = make_tokenizer()
    backend = base.backend_tokenizer
    backend.add_special_tokens(["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"])
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                           special_tokens=[("<s>", backend.token_to_id("<s>"))])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="<|eot_id|>",
                                  chat_template=RICH_TEMPLATE, clean_up_tokenization_spaces=True)
    return _save(tok, tmp_path / "llama3")


def _wordlevel_dir(tmp_path: Path) -> Path:
    from benchmarks.shapes import write_wordlevel_tokenizer

    out = tmp_path / "wordlevel"
    out.mkdir()
    write_wordlevel_tokenizer(out, 1000)
    return out


def _assert_same_as_transformers(path: Path) -> None:
    from transformers import AutoTokenizer

    ours, ref = load_tokenizer_dir(path), AutoTokenizer.from_pretrained(str(path))
    assert isinstance(ours, FastTokenizer)
    assert (len(ours), ours.bos_token_id, ours.eos_token_id) == (len(ref), ref.bos_token_id, ref.eos_token_id)
    assert ours.special_tokens_map == ref.special_tokens_map
    texts = TEXTS + [" ".join(f"t{i}" for i in range(0, 1200, 7))]
    for text in texts:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == ref.encode(text, add_special_tokens=special), text
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    every_id = list(range(len(ref)))
    assert ours.decode(every_id, skip_special_tokens=False) == ref.decode(every_id, skip_special_tokens=False)
    assert ours.decode(every_id, skip_special_tokens=True) == ref.decode(every_id, skip_special_tokens=True)
    assert bool(ours.chat_template) == bool(ref.chat_template)
    if ref.chat_template:
        for gen in (True, False):
            assert ours.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=gen) == \
                ref.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=gen)


@pytest.mark.parametrize("make", [_bpe_dir, _llama3_like_dir, _wordlevel_dir])
def test_same_tokenizer_as_transformers(tmp_path, make):
    _assert_same_as_transformers(make(tmp_path))


def test_default_model_tokenizer_is_the_same_and_loads_without_transformers():
    _assert_same_as_transformers(DEFAULT_MODEL_DIR)
    assert isinstance(Tokenizer(DEFAULT_MODEL_DIR).hf, FastTokenizer)


def test_template_errors_are_kestrel_errors(tmp_path):
    from kestrel.errors import KestrelError

    tok = Tokenizer(_llama3_like_dir(tmp_path))
    assert isinstance(tok.hf, FastTokenizer)
    with pytest.raises(KestrelError, match="system first"):
        tok.apply_chat_template([{"role": "user", "content": "no system"}])
    with pytest.raises(KestrelError, match="empty conversation"):
        tok.apply_chat_template([])


def test_tokenizer_wrapper_and_detokenizer_agree_with_transformers(tmp_path):
    """Tokenizer on the fast path against the same wrapper over AutoTokenizer: ids, eos set, streamed text."""
    from transformers import AutoTokenizer

    path = _llama3_like_dir(tmp_path)
    ours = Tokenizer(path, (7,))
    ref = Tokenizer(path, (7,))
    ref.hf = AutoTokenizer.from_pretrained(str(path))
    assert (ours.eos_token_ids, ours.bos_token_id, ours.vocab_size) == (ref.eos_token_ids, ref.bos_token_id,
                                                                         len(ref.hf))
    assert ours.apply_chat_template(MESSAGES) == ref.apply_chat_template(MESSAGES)
    ids = ours.encode("héllo wörld ✓ 日本 and more", add_special_tokens=False)
    streams = [IncrementalDetokenizer(t) for t in (ours, ref)]
    for i in ids:
        assert streams[0].add([i]) == streams[1].add([i])


@pytest.mark.parametrize("change", [
    {"tokenizer_class": "LlamaTokenizer"},                   # a model-specific class may rebuild the tokenizer
    {"eos_token": "<|not_in_vocab|>"},                       # transformers would add it
    {"additional_special_tokens": ["<|not_in_vocab|>"]},
    {"chat_template": [{"name": "default", "template": "x"}]},
    {"split_special_tokens": True},
])
def test_what_it_cannot_reproduce_goes_to_transformers(tmp_path, change):
    path = _bpe_dir(tmp_path, **change)
    assert load_tokenizer_dir(path) is None


def test_legacy_special_tokens_map_goes_to_transformers(tmp_path):
    path = _bpe_dir(tmp_path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.pop("added_tokens_decoder", None)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<s>"}))
    assert load_tokenizer_dir(path) is None


def test_special_token_only_in_the_vocab_goes_to_transformers(tmp_path):
    """transformers makes such a token special (decode then skips it): the plain backend would not."""
    from tokenizers import Tokenizer as Backend, models, pre_tokenizers

    backend = Backend(models.WordLevel({"a": 0, "b": 1, "<eos>": 2}, unk_token="a"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    assert load_tokenizer_dir(tmp_path) is None
    assert Tokenizer(tmp_path).decode([0, 2]) == "a"   # AutoTokenizer's answer


def test_added_token_flags_must_agree_with_the_config(tmp_path):
    path = _llama3_like_dir(tmp_path)
    backend = json.loads((path / "tokenizer.json").read_text())
    decoder = {str(t["id"]): {k: t[k] for k in ("content", "single_word", "lstrip", "rstrip", "normalized",
                                                   "special")} for t in backend["added_tokens"]}
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "added_tokens_decoder": decoder}))
    assert isinstance(load_tokenizer_dir(path), FastTokenizer)   # as Llama-3.1's config lists them
    _assert_same_as_transformers(path)
    decoder[next(iter(decoder))]["lstrip"] = True
    config_path.write_text(json.dumps({**config, "added_tokens_decoder": decoder}))
    assert load_tokenizer_dir(path) is None


def test_chat_template_file_wins_over_the_config(tmp_path):
    path = _bpe_dir(tmp_path, chat_template="from config")
    (path / "chat_template.jinja").write_text("from file")
    assert load_tokenizer_dir(path).chat_template == "from file"


def test_wordlevel_shape_tokenizer_round_trips_every_word(tmp_path):
    """The random-weight shapes' tokenizer: every non-special id is one word that encodes back to itself, so a
    benchmark's random prompts keep their tokens (a special named like a word's start would split "t100" in two)."""
    tok = load_tokenizer_dir(_wordlevel_dir(tmp_path))
    words = list(range(3, len(tok)))
    assert tok.encode(tok.decode(words), add_special_tokens=False) == words
    assert (tok.bos_token_id, tok.eos_token_id) == (0, 1)
