"""Held-out perplexity of a causal LM directory on the running interpreter's ``Lib/test``.

The default model is trained on the standard library minus its test suite, so ``Lib/test`` is text the model
never saw. The scoring is split so other engines can reuse it: ``heldout_windows`` picks and tokenizes a fixed
subset, ``token_nlls`` turns any engine's per-token logits into per-token losses, and ``perplexity`` folds them.

    python scripts/eval_default_model.py models/kestrel-tiny --files 64 --max-tokens 1024
"""
from __future__ import annotations

import argparse
import hashlib
import math
import sysconfig
from pathlib import Path

import torch

WINDOW = 1024  # the context the default model is trained on
BOS_TOKEN = "<|bos|>"


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def path_hash(relative: str) -> int:
    """Stable across runs and interpreters (unlike the salted built-in ``hash``)."""
    return int.from_bytes(hashlib.sha1(relative.encode()).digest()[:8], "big")


def heldout_files(num_files: int, root: Path | None = None) -> list[Path]:
    """The first ``num_files`` non-empty ``Lib/test/**/*.py`` files in path-hash order: a fixed pseudo-random
    subset that does not depend on the filesystem's listing order. Empty if the interpreter ships no tests."""
    test_dir = (root or stdlib_root()) / "test"
    candidates = [p for p in test_dir.rglob("*.py") if "__pycache__" not in p.parts and p.stat().st_size > 0]
    candidates.sort(key=lambda p: (path_hash(p.relative_to(test_dir).as_posix()), p.as_posix()))
    return candidates[:num_files]


def heldout_windows(tokenizer, files: list[Path], max_tokens: int = WINDOW, window: int = WINDOW) -> list[list[int]]:
    """Each file becomes BOS + its tokens, cut to ``max_tokens`` and split into windows scored independently.

    ``tokenizer`` is a ``tokenizers.Tokenizer`` or a transformers tokenizer; BOS is added explicitly so both
    give the same ids."""
    bos_id = _bos_id(tokenizer)
    windows: list[list[int]] = []
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        ids = [bos_id] + _encode_plain(tokenizer, text)
        ids = ids[:max_tokens]
        windows.extend(ids[start:start + window] for start in range(0, len(ids), window) if len(ids) - start > 1)
    return windows


def token_nlls(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Per-token negative log-likelihood of one sequence.

    logits: [T, V], row i is the distribution for token i + 1; token_ids: [T]. Returns [T - 1] in float32."""
    assert logits.dim() == 2 and token_ids.dim() == 1 and logits.shape[0] == token_ids.shape[0]
    return torch.nn.functional.cross_entropy(logits[:-1].float(), token_ids[1:].to(logits.device), reduction="none")


def perplexity(nlls: list[torch.Tensor]) -> float:
    """exp of the mean NLL over all scored tokens of all windows (token-weighted, not window-weighted)."""
    total = torch.cat([n.flatten().double().cpu() for n in nlls])
    return math.exp(total.mean().item())


@torch.no_grad()
def hf_window_nlls(model, windows: list[list[int]], device: str | torch.device) -> list[torch.Tensor]:
    nlls = []
    for ids in windows:
        input_ids = torch.tensor([ids], device=device)
        logits = model(input_ids=input_ids).logits[0]
        nlls.append(token_nlls(logits, input_ids[0]))
    return nlls


def hf_heldout_perplexity(model_dir: Path, num_files: int, max_tokens: int = WINDOW,
                          device: str = "cpu", dtype: torch.dtype = torch.float32) -> tuple[float, int]:
    """(perplexity, scored tokens) of the HF checkpoint in ``model_dir`` on the fixed held-out subset."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    files = heldout_files(num_files)
    if not files:
        raise RuntimeError(f"{stdlib_root() / 'test'} has no .py files: this interpreter ships without its tests")
    nlls = hf_window_nlls(model, heldout_windows(tokenizer, files, max_tokens), device)
    return perplexity(nlls), sum(n.numel() for n in nlls)


def _bos_id(tokenizer) -> int:
    if hasattr(tokenizer, "bos_token_id") and tokenizer.bos_token_id is not None:
        return int(tokenizer.bos_token_id)
    return int(tokenizer.token_to_id(BOS_TOKEN))


def _encode_plain(tokenizer, text: str) -> list[int]:
    # A transformers tokenizer wraps a tokenizers.Tokenizer; using it directly skips the model_max_length warning.
    raw = getattr(tokenizer, "backend_tokenizer", tokenizer)
    return raw.encode(text, add_special_tokens=False).ids



def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--files", type=int, default=64, help="number of Lib/test files (fixed hash order)")
    parser.add_argument("--max-tokens", type=int, default=WINDOW, help="tokens per file, BOS included")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    ppl, tokens = hf_heldout_perplexity(args.model_dir, args.files, args.max_tokens, args.device)
    print(f"held-out perplexity {ppl:.3f} over {tokens} tokens of {args.files} files of {stdlib_root() / 'test'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
