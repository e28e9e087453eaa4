"""The GGUF's embedded vocabulary -> a `tokenizers` byte-level BPE tokenizer wrapped for transformers.

llama.cpp stores the HF tokenizer as lists (tokens, token types, merges) plus a pre-tokenizer name
(`tokenizer.ggml.pre`) and the chat template; this rebuilds what the original tokenizer.json described.
"""
from __future__ import annotations

import logging
from pathlib import Path

from kestrel.errors import ModelLoadError
from kestrel.models.gguf.reader import field, open_gguf

logger = logging.getLogger("kestrel.gguf")

# llama.cpp token types (gguf.TokenType): CONTROL tokens are the special ones (<|im_end|>, ...); USER_DEFINED
# tokens are matched whole but decoded as text.
CONTROL, USER_DEFINED = 3, 4

# The GPT-2 split (tokenizers' ByteLevel(use_regex=True) uses this one) and Llama-3's, which groups digits by 3.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
LLAMA3_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                  r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
# tokenizer.ggml.pre -> (split each digit first, regex). SmolLM's and StarCoder's tokenizer.json put
# Digits(individual_digits=True) before the GPT-2 byte-level split.
PRE_TOKENIZERS = {
    "default": (False, GPT2_PATTERN),
    "gpt-2": (False, GPT2_PATTERN),
    "gpt2": (False, GPT2_PATTERN),
    "smollm": (True, GPT2_PATTERN),
    "starcoder": (True, GPT2_PATTERN),
    "refact": (True, GPT2_PATTERN),
    "llama-bpe": (False, LLAMA3_PATTERN),
    "llama3": (False, LLAMA3_PATTERN),
}


def build_backend(path: Path):
    """A `tokenizers.Tokenizer` equal to the one the GGUF was converted from (byte-level BPE vocabularies)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE

    reader = open_gguf(path)
    kind = field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelLoadError(f"{path}: tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2'; "
                             "SentencePiece 'llama' vocabularies are not)")
    tokens: list[str] = field(reader, "tokenizer.ggml.tokens") or []
    merges: list[str] = field(reader, "tokenizer.ggml.merges") or []
    types: list[int] = field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    if not tokens or not merges:
        raise ModelLoadError(f"{path}: GGUF metadata lacks the tokenizer's tokens or merges")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = Tokenizer(BPE(vocab, pairs, fuse_unk=False, byte_fallback=False))

    pre = field(reader, "tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        logger.warning("%s: pre-tokenizer %r unknown to Kestrel, using GPT-2's split", path.name, pre)
    digits, pattern = PRE_TOKENIZERS.get(pre, PRE_TOKENIZERS["default"])
    steps = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
    steps += [pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
              pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)]
    backend.pre_tokenizer = pre_tokenizers.Sequence(steps)
    backend.decoder = decoders.ByteLevel()

    specials = [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if t == CONTROL]
    backend.add_special_tokens(specials)
    user = [AddedToken(tokens[i], special=False, normalized=False) for i, t in enumerate(types) if t == USER_DEFINED]
    if user:
        backend.add_tokens(user)
    bos = field(reader, "tokenizer.ggml.bos_token_id")
    if field(reader, "tokenizer.ggml.add_bos_token", False) and bos is not None:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A {tokens[bos]} $B", special_tokens=[(tokens[bos], bos)])
    return backend


def special_tokens(path: Path) -> dict[str, str]:
    """bos/eos/unk/pad as token strings. eos is the model's real end token (SmolLM2: id 2 `<|im_end|>`), not
    the bos that transformers' GGUF tokenizer reports."""
    reader = open_gguf(path)
    tokens = field(reader, "tokenizer.ggml.tokens") or []
    out = {}
    for role in ("bos", "eos", "unk", "pad"):
        key = "unknown_token_id" if role == "unk" else ("padding_token_id" if role == "pad" else f"{role}_token_id")
        idx = field(reader, f"tokenizer.ggml.{key}")
        if idx is not None and 0 <= int(idx) < len(tokens):
            out[f"{role}_token"] = tokens[int(idx)]
    return out


def load_gguf_fast_tokenizer(path: Path):
    """`build_backend` wrapped without transformers (fast_tokenizer.py): what `load_gguf_tokenizer` gives, in
    ~0.1 s rather than seconds of importing transformers. None when transformers would change the backend (a
    special token that is not an added token yet): the caller then uses `load_gguf_tokenizer`."""
    from kestrel.models.fast_tokenizer import FastTokenizer

    backend = build_backend(path)
    specials = special_tokens(path)
    added = {token.content for token in backend.get_added_tokens_decoder().values()}
    if any(token not in added for token in specials.values()):
        return None
    return FastTokenizer(backend, specials, field(open_gguf(path), "tokenizer.chat_template"))


def load_gguf_tokenizer(path: Path):
    """A transformers fast tokenizer (encode, decode, apply_chat_template) over `build_backend`."""
    from transformers import PreTrainedTokenizerFast

    backend = build_backend(path)
    template = field(open_gguf(path), "tokenizer.chat_template")
    try:
        return PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=template,
                                       clean_up_tokenization_spaces=False, **special_tokens(path))
    except Exception as exc:  # transformers' own validation of the special tokens
        raise ModelLoadError(f"{path}: cannot build the tokenizer ({exc})") from None
