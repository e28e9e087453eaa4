"""What the benchmark sends: the 3 fixed prompts, random lengths, JSONL prompts, shared-prefix groups.

Every generator returns `BenchRequest`s. `prompt_len` is the client's estimate (tokenizer count, or word count
without a tokenizer); the server's `usage.prompt_tokens`, when reported, is what the metrics use.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from kestrel.bench.tokenizer import BenchTokenizer
from kestrel.errors import KestrelError

# The classic tuning-report prompts: short, open-ended, so 256 tokens of output are natural text.
FIXED_PROMPTS = (
    "Explain the theory of relativity in simple terms.",
    "Write a short story about a robot who learns to paint.",
    "List the steps to bake a loaf of sourdough bread, with tips for beginners.",
)

# Random-word prompts when no tokenizer is given: common short words are ~1 token each in BPE vocabularies.
_WORDS = (
    "the of and to in is was for on that with as by at from his her an were are which this be or had not but "
    "one all their there been has have when who will more no if out so said what up its about into than them "
    "can only other new some could time these two may then do first any my now such like our over man me even "
    "most made after also did many before must through back years where much your way well down should because "
    "each just those people how too little state good very make world still own see men work long get here "
    "between both life being under never day same another know while last might us great old year off come "
    "since against go came right used take three"
).split()


@dataclass(frozen=True, slots=True)
class BenchRequest:
    prompt: str
    prompt_len: int       # client-side estimate, tokens
    output_len: int       # max_tokens asked for


def fixed_requests(output_len: int, num: int | None = None) -> list[BenchRequest]:
    """The 3 fixed prompts, cycled to `num` requests (default 3)."""
    num = len(FIXED_PROMPTS) if num is None else num
    return [BenchRequest(p, len(p.split()), output_len) for p in (FIXED_PROMPTS[i % 3] for i in range(num))]


def _random_text(rng: random.Random, num_tokens: int, tokenizer: BenchTokenizer | None) -> str:
    if tokenizer is None:
        return " ".join(rng.choice(_WORDS) for _ in range(num_tokens))
    # vLLM's random dataset: random token ids decoded to text (re-encoding may shift the length slightly).
    return tokenizer.decode([rng.randrange(tokenizer.vocab_size) for _ in range(num_tokens)])


def _length(rng: random.Random, mean: int, range_ratio: float) -> int:
    low, high = int(mean * (1 - range_ratio)), int(mean * (1 + range_ratio))
    return max(1, rng.randint(low, max(low, high)))


def _estimate(text: str, tokenizer: BenchTokenizer | None) -> int:
    return tokenizer.count(text) if tokenizer else len(text.split())


def random_requests(num: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                    tokenizer: BenchTokenizer | None = None, seed: int = 0) -> list[BenchRequest]:
    """Prompts of ~input_len tokens and outputs of output_len tokens, each uniform in [len*(1-r), len*(1+r)]."""
    if not 0.0 <= range_ratio < 1.0:
        raise KestrelError(f"--range-ratio {range_ratio} is invalid: expected a number in [0, 1)")
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        text = _random_text(rng, _length(rng, input_len, range_ratio), tokenizer)
        out.append(BenchRequest(text, _estimate(text, tokenizer), _length(rng, output_len, range_ratio)))
    return out


def shared_prefix_requests(num_groups: int, prompts_per_group: int, prefix_len: int, suffix_len: int,
                           output_len: int, tokenizer: BenchTokenizer | None = None,
                           seed: int = 0) -> list[BenchRequest]:
    """`num_groups` random prefixes, each shared by `prompts_per_group` prompts with their own random suffix.

    Shuffled, as SGLang's generated-shared-prefix dataset does, so the prefix cache sees interleaved groups.
    """
    rng = random.Random(seed)
    out = []
    for _ in range(num_groups):
        prefix = _random_text(rng, prefix_len, tokenizer)
        for _ in range(prompts_per_group):
            text = prefix + " " + _random_text(rng, suffix_len, tokenizer)
            out.append(BenchRequest(text, _estimate(text, tokenizer), output_len))
    rng.shuffle(out)
    return out


def jsonl_requests(path: str, output_len: int, tokenizer: BenchTokenizer | None = None,
                   num: int | None = None) -> list[BenchRequest]:
    """One JSON object per line: {"prompt": str, "output_len": int (optional, default --output-len)}."""
    file = Path(path)
    if not file.is_file():
        raise KestrelError(f"--dataset-path {path!r} is invalid: no such file")
    out = []
    for lineno, line in enumerate(file.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompt, length = row["prompt"], int(row.get("output_len", output_len))
        except (ValueError, KeyError, TypeError) as exc:
            raise KestrelError(f"{path}:{lineno} is invalid ({exc}): expected "
                               '{"prompt": "...", "output_len": N} with output_len optional') from exc
        if not isinstance(prompt, str) or not prompt or length < 1:
            raise KestrelError(f"{path}:{lineno} is invalid: expected a non-empty prompt and output_len >= 1")
        out.append(BenchRequest(prompt, _estimate(prompt, tokenizer), length))
    if not out:
        raise KestrelError(f"--dataset-path {path!r} is invalid: no prompts in it")
    if num is not None:
        out = [out[i % len(out)] for i in range(num)]
    return out
