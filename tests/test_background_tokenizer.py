"""The tokenizer loads on a thread during startup (kestrel/models/tokenizer.py BackgroundTokenizer): the same
Tokenizer as a direct load, a directory with no tokenizer fails at once, a broken one when its result is asked for,
and the server's copy (frontend/engine_process.py) reports a broken tokenizer as a failed start."""
from __future__ import annotations

import shutil

import pytest

from kestrel.errors import ModelLoadError
from kestrel.models.tokenizer import BackgroundTokenizer, Tokenizer


def test_same_tokenizer_as_a_direct_load(checkpoint_factory):
    path = checkpoint_factory("llama")
    loaded = BackgroundTokenizer(path, (7,)).result()
    direct = Tokenizer(path, (7,))
    text = "def add(a, b):\n    return a + b"
    assert loaded.encode(text) == direct.encode(text)
    assert loaded.eos_token_ids == direct.eos_token_ids and 7 in loaded.eos_token_ids


def test_no_tokenizer_files_fail_before_any_thread(tmp_path):
    with pytest.raises(ModelLoadError, match="no tokenizer.json"):
        BackgroundTokenizer(tmp_path)


def test_a_broken_tokenizer_fails_when_its_result_is_asked_for(checkpoint_factory, tmp_path):
    path = tmp_path / "broken"
    shutil.copytree(checkpoint_factory("llama"), path)
    (path / "tokenizer.json").write_text("{ not json")
    (path / "tokenizer_config.json").write_text('{"tokenizer_class": "NoSuchTokenizerClass"}')
    load = BackgroundTokenizer(path)
    with pytest.raises(ModelLoadError, match="cannot load the tokenizer"):
        load.result()
    assert load.done
