"""A `tokenizers.Tokenizer` with the few transformers behaviours Kestrel uses, loaded without transformers.

Why: `AutoTokenizer.from_pretrained` first imports transformers' auto classes, which pull in torch._dynamo,
generation and modeling code: 2-3 s of the server's start on a warm disk (more on a fresh machine), paid twice
(the engine process resolving the model, then the server process when the engine is ready), while the
tokenizer itself loads from tokenizer.json in ~0.1 s. This module reproduces what transformers (v5) does for a
tokenizer that tokenizer.json fully describes; `load_tokenizer_dir` returns None for anything else (a
model-specific tokenizer class, legacy special-token files, tokens the config adds), and the caller falls back
to AutoTokenizer, so no tokenizer changes behaviour.
"""
from __future__ import annotations

import json
import logging
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

logger = logging.getLogger("kestrel.tokenizer")

# transformers' named special tokens (SPECIAL_TOKENS_ATTRIBUTES), passed to chat templates by name.
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Classes whose tokenizer is tokenizer.json as it is; model-specific classes may rebuild parts of it.
GENERIC_CLASSES = (None, "PreTrainedTokenizerFast", "TokenizersBackend")
# Added-token flags that must agree between tokenizer_config.json and tokenizer.json (else transformers re-adds).
ADDED_TOKEN_FLAGS = ("content", "single_word", "lstrip", "rstrip", "normalized", "special")
# Longer texts are tokenized without holding the GIL (a server tokenizes on a worker thread, and a 1 MB prompt held
# it for 1.5 s, stalling the event loop all that time); shorter ones take the direct call, a few us cheaper.
RELEASE_GIL_CHARS = 16 * 1024


class FastTokenizer:
    """encode/decode/apply_chat_template with transformers' semantics, over a `tokenizers.Tokenizer`."""

    def __init__(self, backend, special_tokens: dict[str, str], chat_template: str | None = None) -> None:
        self.backend = backend
        self.special_tokens_map = special_tokens   # the named ones: bos_token, eos_token, ... -> their text
        self.chat_template = chat_template
        self.bos_token_id = self._id_of(special_tokens.get("bos_token"))
        self.eos_token_id = self._id_of(special_tokens.get("eos_token"))
        self._vocab_size = backend.get_vocab_size(with_added_tokens=True)

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    def __len__(self) -> int:
        return self._vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > RELEASE_GIL_CHARS:   # encode_batch tokenizes without the GIL; encode holds it throughout
            return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: int | list[int]) -> str | list[str]:
        if isinstance(ids, int):
            return self.backend.id_to_token(ids)
        return [self.backend.id_to_token(i) for i in ids]

    def apply_chat_template(self, messages: list[dict], tokenize: bool = True, add_generation_prompt: bool = False,
                            **kwargs: Any) -> str | list[int]:
        """Renders like transformers' render_jinja_template: the special tokens and kwargs are template variables."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        if not messages:   # as transformers: a template would render just its prologue
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        text = compile_chat_template(self.chat_template).render(
            messages=messages, tools=kwargs.pop("tools", None), documents=kwargs.pop("documents", None),
            add_generation_prompt=add_generation_prompt, **{**self.special_tokens_map, **kwargs})
        return self.encode(text, add_special_tokens=False) if tokenize else text


@lru_cache(maxsize=8)
def compile_chat_template(template: str):
    """The jinja environment transformers renders chat templates in (utils/chat_template_utils.py): sandboxed,
    trim_blocks + lstrip_blocks, loop controls, a tojson that does not escape HTML, raise_exception and
    strftime_now. Its {% generation %} tag only marks assistant spans, so it is a plain block here."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def load_tokenizer_dir(path: Path) -> FastTokenizer | None:
    """The tokenizer in a HF directory when tokenizer.json fully describes it, else None (use transformers)."""
    if not (path / "tokenizer.json").is_file():
        return None
    config = _read_json(path / "tokenizer_config.json")
    if config is None or not _config_is_plain(path, config):
        return None
    from tokenizers import Tokenizer

    backend = Tokenizer.from_file(str(path / "tokenizer.json"))
    special = {name: _token_text(config[name]) for name in NAMED_SPECIAL_TOKENS if config.get(name) is not None}
    if not _backend_matches(backend, config, special):
        return None
    if config.get("clean_up_tokenization_spaces") and type(backend.model).__name__ != "BPE":
        return None   # transformers cleans up spaces for non-BPE models (and ignores the flag for BPE)
    template = _chat_template(path, config)
    if template is False:
        return None
    return FastTokenizer(backend, special, template)


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _config_is_plain(path: Path, config: dict) -> bool:
    """No model-specific class, no legacy files transformers would merge in, no options that change encoding."""
    if config.get("tokenizer_class") not in GENERIC_CLASSES or "auto_map" in config:
        return False
    if (path / "added_tokens.json").exists() or (path / "chat_templates").is_dir():
        return False
    if "added_tokens_decoder" not in config and (path / "special_tokens_map.json").exists():
        return False   # legacy: transformers takes the special tokens from special_tokens_map.json
    if config.get("split_special_tokens") or config.get("fast_tokenizer_files"):
        return False
    return not isinstance(config.get("chat_template"), (list, dict))   # named templates: rare, left to transformers


def _token_text(value: Any) -> str:
    return value["content"] if isinstance(value, dict) else str(value)


def _backend_matches(backend, config: dict, special: dict[str, str]) -> bool:
    """True when transformers would leave the backend as loaded: every added token of the config is already in
    tokenizer.json with the same flags, every special token (named, extra or model-specific) is an added token
    there, and no truncation or padding is configured."""
    if backend.truncation is not None or backend.padding is not None:
        return False
    added = backend.get_added_tokens_decoder()
    for idx, entry in (config.get("added_tokens_decoder") or {}).items():
        have = added.get(int(idx))
        if not isinstance(entry, dict) or have is None:
            return False
        if any(entry.get(flag, getattr(have, flag)) != getattr(have, flag) for flag in ADDED_TOKEN_FLAGS):
            return False
    if isinstance(config.get("extra_special_tokens"), dict):
        return False   # model-specific named tokens: transformers makes attributes of them
    extra = [t for key in ("additional_special_tokens", "extra_special_tokens") for t in (config.get(key) or [])]
    model_specific = [v for k, v in config.items() if k.endswith("_token")]   # add_bos_token etc. are bools
    tokens = [t for t in extra + model_specific if isinstance(t, str) or (isinstance(t, dict) and "content" in t)]
    # transformers adds (as special) every special token that is not an added token yet, even one in the vocab
    added_contents = {token.content for token in added.values()}
    return all(_token_text(t) in added_contents for t in tokens + list(special.values()))


def _chat_template(path: Path, config: dict) -> str | None | bool:
    """chat_template.jinja wins over the config's entry (as in transformers); False: unreadable."""
    file = path / "chat_template.jinja"
    if file.is_file():
        try:
            return file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            return False
    template = config.get("chat_template")
    return template if isinstance(template, str) else None
