"""The target model's tokenizer for the benchmark: exact-length random prompts and token counts without `usage`."""
from __future__ import annotations

import random
from pathlib import Path

from kestrel.errors import KestrelError
from kestrel.models.gguf import is_gguf

_FIX_ROUNDS = 10     # decode/re-encode rounds on one draw (vLLM's retry budget)
_FRESH_DRAWS = 10    # fresh draws before giving up: then the prompt's real length is reported


class BenchTokenizer:
    """A thin wrapper over `tokenizers.Tokenizer` (fast, no transformers import)."""

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer

        file = tokenizer_file(path)
        if file is None:
            raise KestrelError(f"--tokenizer {path!r} is invalid: expected a directory with tokenizer.json, "
                               "a tokenizer.json file or a .gguf file")
        self.path = str(file)
        if is_gguf(file):   # a GGUF carries its vocabulary: rebuilt as the server rebuilds it
            from kestrel.models.gguf.tokenizer import build_backend

            self._tok = build_backend(file)
        else:
            self._tok = Tokenizer.from_file(str(file))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=False)
        # Random prompts draw from the ordinary vocabulary: an added/special token (BOS, EOS, <|im_start|>) would
        # change what the model sees, and decode() drops it, which would break the prompt's length.
        added = set(self._tok.get_added_tokens_decoder())
        full = self._tok.get_vocab_size(with_added_tokens=True)
        self.prompt_token_ids = [i for i in range(full) if i not in added]

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def count(self, text: str) -> int:
        return len(self.encode(text)) if text else 0

    def text_of_length(self, ids: list[int], rng: random.Random, keep: int = 0) -> tuple[str, int]:
        """Text that re-encodes to len(ids) tokens, and its token count (len(ids) unless every try failed).

        decode(ids) may re-encode to a different length (two tokens merge, one splits). As vLLM's random dataset
        does, re-encode, then cut the excess or append random tokens, until the lengths agree; where that does not
        converge, start again from fresh random tokens after the first `keep` (the prompt's distinct head).
        """
        target = len(ids)
        for _ in range(_FRESH_DRAWS):
            attempt = ids
            for _ in range(_FIX_ROUNDS):
                text = self.decode(attempt)
                attempt = self.encode(text)
                if len(attempt) == target:
                    return text, target
                attempt = attempt[:target] + self.random_ids(rng, target - len(attempt))
            ids = ids[:keep] + self.random_ids(rng, target - keep)
        text = self.decode(ids)
        return text, self.count(text)

    def random_ids(self, rng: random.Random, n: int) -> list[int]:
        return [rng.choice(self.prompt_token_ids) for _ in range(n)]


def tokenizer_file(path: str) -> Path | None:
    """`path` itself when it is a tokenizer.json or a .gguf checkpoint (its vocabulary is inside: what `kestrel
    serve m.gguf` reports as its root), `path/tokenizer.json` for a directory, else None."""
    file = Path(path).expanduser()
    if file.is_dir():
        file = file / "tokenizer.json"
    return file if file.is_file() and (file.suffix == ".json" or is_gguf(file)) else None


def load_tokenizer(path: str | None, model_names: tuple[str | None, ...] = ()) -> BenchTokenizer | None:
    """--tokenizer (a directory, a tokenizer.json, a .gguf or a Hub id), else the first of `model_names` (--model,
    the served id and root) that is a local checkpoint directory with a tokenizer.json or a local .gguf, else the
    first that is a Hub id whose tokenizer files huggingface_hub can fetch (as vLLM's benchmark does), else None
    (random prompts fall back to common words)."""
    from kestrel.models.names import is_hub_name, resolve_model

    if path:
        return BenchTokenizer(str(resolve_model(path, fetch=True, weights=False)) if is_hub_name(path) else path)
    for name in model_names:
        if name and tokenizer_file(name) is not None:
            try:
                return BenchTokenizer(name)
            except KestrelError:   # e.g. a GGUF whose vocabulary Kestrel cannot rebuild: try the next one
                continue
    for name in model_names:
        if name and is_hub_name(name):
            try:
                return BenchTokenizer(str(resolve_model(name, fetch=True, weights=False)))
            except KestrelError:   # a served name that only looks like an id, or no Hub from here: next one
                continue
    return None
