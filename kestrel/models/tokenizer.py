"""HF tokenizer wrapper: encode, chat template, and an incremental detokenizer for streaming."""
from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

from kestrel.errors import KestrelError, ModelLoadError

logger = logging.getLogger("kestrel.tokenizer")


class Tokenizer:
    def __init__(self, path: Path, model_eos_ids: tuple[int, ...] = ()) -> None:
        if path.suffix.lower() == ".gguf":   # the vocabulary, merges and chat template live in the file
            from kestrel.models.gguf.tokenizer import load_gguf_fast_tokenizer, load_gguf_tokenizer
            self.hf = load_gguf_fast_tokenizer(path) or load_gguf_tokenizer(path)
        else:
            self.hf = self._load_dir(path)
        eos = set(model_eos_ids)
        if self.hf.eos_token_id is not None:
            eos.add(int(self.hf.eos_token_id))
        gen_cfg = path / "generation_config.json"
        if gen_cfg.is_file():
            value = json.loads(gen_cfg.read_text()).get("eos_token_id")
            eos.update([value] if isinstance(value, int) else (value or []))
        self.eos_token_ids: set[int] = eos
        self.bos_token_id = self.hf.bos_token_id
        self.vocab_size = len(self.hf)

    @staticmethod
    def _load_dir(path: Path):
        if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
            raise ModelLoadError(f"no tokenizer.json or tokenizer_config.json in {path}")
        fast = Tokenizer._load_fast(path)
        if fast is not None:
            return fast
        from transformers import AutoTokenizer   # slow import: only when a tokenizer is really needed

        try:
            return AutoTokenizer.from_pretrained(str(path))
        except Exception as exc:  # transformers raises many types for broken tokenizer files
            raise ModelLoadError(f"cannot load the tokenizer in {path}: {exc}") from None

    @staticmethod
    def _load_fast(path: Path):
        """tokenizer.json through `tokenizers` alone (fast_tokenizer.py): None when it needs transformers."""
        from kestrel.models.fast_tokenizer import load_tokenizer_dir

        try:
            return load_tokenizer_dir(path)
        except Exception as exc:  # a tokenizer.json `tokenizers` rejects: transformers says why, or converts it
            logger.debug("tokenizer.json in %s needs transformers: %s", path, exc)
            return None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> list[int]:
        """`tools`: OpenAI-shaped tool definitions, the template's `tools` variable (only passed when given: a
        template tests `tools is defined` or `tools` itself)."""
        if not self.has_chat_template:
            raise KestrelError("this model's tokenizer has no chat template; use the completions endpoint "
                               "or a model whose tokenizer_config.json has `chat_template`")
        try:
            extra = {"tools": tools} if tools else {}
            text = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                               **extra)
        except Exception as exc:  # jinja errors: a message the template cannot render
            raise KestrelError(f"the chat template could not render these messages: {exc}") from None
        # The template writes BOS itself when it wants one.
        return self.encode(text, add_special_tokens=False)


class BackgroundTokenizer:
    """A Tokenizer loaded on a thread while startup does other work (building the model, loading weights):
    a large vocabulary, and importing transformers, take seconds. The files' presence is checked at once, so a
    directory with no tokenizer still fails before any weights are read."""

    def __init__(self, path: Path, model_eos_ids: tuple[int, ...] = ()) -> None:
        if path.suffix.lower() != ".gguf" and not (path / "tokenizer.json").is_file() \
                and not (path / "tokenizer_config.json").is_file():
            raise ModelLoadError(f"no tokenizer.json or tokenizer_config.json in {path}")
        self._args = (path, model_eos_ids)
        self._result: Tokenizer | BaseException | None = None
        self._thread = threading.Thread(target=self._load, name="kestrel-tokenizer-load", daemon=True)
        self._thread.start()

    def _load(self) -> None:
        try:
            self._result = Tokenizer(*self._args)
        except BaseException as exc:   # noqa: BLE001 - raised again by result(), on the caller's thread
            self._result = exc

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self) -> Tokenizer:
        self._thread.join()
        if isinstance(self._result, BaseException):
            raise self._result
        return self._result


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without re-decoding everything each time.

    Byte-level BPE can split one character over several tokens; a delta is emitted only once the decoded text
    no longer ends in U+FFFD (an incomplete UTF-8 sequence).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.prefix_offset = 0   # tokens before this are settled and only give context
        self.read_offset = 0     # text of tokens [prefix_offset, read_offset) was already emitted

    def add(self, new_ids: list[int]) -> str:
        self.token_ids.extend(new_ids)
        decode = self.tokenizer.decode
        prefix = (decode(self.token_ids[self.prefix_offset:self.read_offset], self.skip_special_tokens)
                  if self.read_offset > self.prefix_offset else "")   # the first token's: no call for nothing
        full = decode(self.token_ids[self.prefix_offset:], self.skip_special_tokens)
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""
        delta = full[len(prefix):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return delta
