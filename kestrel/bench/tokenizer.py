"""Optional HF tokenizer for the benchmark: builds random-token prompts and counts tokens when `usage` is absent."""
from __future__ import annotations

from pathlib import Path

from kestrel.errors import KestrelError


class BenchTokenizer:
    """A thin wrapper over `tokenizers.Tokenizer` (fast, no transformers import)."""

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer

        file = Path(path)
        if file.is_dir():
            file = file / "tokenizer.json"
        if not file.is_file():
            raise KestrelError(f"--tokenizer {path!r} is invalid: expected a directory with tokenizer.json "
                               "or a tokenizer.json file")
        self._tok = Tokenizer.from_file(str(file))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=False)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def count(self, text: str) -> int:
        return len(self.encode(text)) if text else 0


def load_tokenizer(path: str | None) -> BenchTokenizer | None:
    return BenchTokenizer(path) if path else None
