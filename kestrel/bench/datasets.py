"""What the benchmark sends. vLLM's `bench serve` datasets under its names (`random`, `sharegpt`,
`prefix-repetition`) and the older `shared-prefix`, `jsonl`, `fixed`.

Every generator returns `BenchRequest`s. Random prompts are built from token ids of the target tokenizer: to
/v1/completions they go as token ids, so the server sees exactly `prompt_len` tokens; to chat they go as text that
re-encodes to that many tokens (the chat template then adds its own). Without a tokenizer they are common words,
about one token each. `prompt_len` is the client's count; the server's `usage.prompt_tokens` is what the report
uses when the server sends it.
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from kestrel.bench.tokenizer import BenchTokenizer
from kestrel.errors import KestrelError

DATASETS = ("random", "sharegpt", "prefix-repetition", "shared-prefix", "jsonl", "fixed")
ALIASES = {"prefix_repetition": "prefix-repetition", "generated-shared-prefix": "shared-prefix"}
DEFAULT_INPUT_LEN = 1024
DEFAULT_OUTPUT_LEN = 128
DEFAULT_NUM_PROMPTS = 200
# The first HEAD_LEN tokens of every random prompt (of every suffix, for prefix-repetition) differ from all the
# others', so no two prompts share a prefix and the prefix cache has nothing to hit beyond what the dataset shares.
HEAD_LEN = 4
# vLLM's ShareGPT filter (is_valid_sequence): drop turns too short to time or too long for small models.
SHAREGPT_MIN_LEN, SHAREGPT_MAX_PROMPT_LEN, SHAREGPT_MAX_TOTAL_LEN = 4, 1024, 2048

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
    prompt: str | list[int]   # token ids are sent as they are (/v1/completions accepts them)
    prompt_len: int           # client-side count, tokens (words without a tokenizer)
    output_len: int           # max_tokens asked for


@dataclass(frozen=True, slots=True)
class DatasetConfig:
    """The dataset flags, named as `vllm bench serve` names them (the older names are aliases)."""
    name: str = "random"
    path: str | None = None                    # sharegpt / jsonl file
    input_len: int | None = None               # --random-input-len; None: 1024, or the preset's
    output_len: int | None = None              # --random-output-len (and every dataset's default); None: 128
    range_ratio: float = 0.0                   # lengths uniform in [len * (1 - r), len * (1 + r)]
    prefix_repetition_prefix_len: int = 256
    prefix_repetition_suffix_len: int = 256
    prefix_repetition_num_prefixes: int = 10
    prefix_repetition_output_len: int | None = None   # None: --random-output-len
    sharegpt_output_len: int | None = None     # None: each conversation's reply length
    num_groups: int = 8                        # shared-prefix: prefixes ...
    prompts_per_group: int = 16                # ... times prompts each
    prefix_len: int = 512
    suffix_len: int = 64

    def __post_init__(self) -> None:
        object.__setattr__(self, "name", ALIASES.get(self.name, self.name))
        if self.name not in DATASETS:
            raise KestrelError(f"--dataset-name {self.name!r} is invalid: expected one of {', '.join(DATASETS)}")
        if self.name in ("sharegpt", "jsonl") and not self.path:
            raise KestrelError(f"--dataset-name {self.name} needs --dataset-path FILE")
        if not 0.0 <= self.range_ratio < 1.0:
            raise KestrelError(f"--random-range-ratio {self.range_ratio} is invalid: expected a number in [0, 1)")
        at_least = {"input_len": 1, "output_len": 1, "prefix_repetition_prefix_len": 0,
                    "prefix_repetition_suffix_len": 0, "prefix_repetition_num_prefixes": 1,
                    "prefix_repetition_output_len": 1, "sharegpt_output_len": 1, "num_groups": 1,
                    "prompts_per_group": 1, "prefix_len": 0, "suffix_len": 0}
        for name, low in at_least.items():
            value = getattr(self, name)
            if value is not None and value < low:
                flag = "random-" + name if name in ("input_len", "output_len") else name
                raise KestrelError(f"--{flag.replace('_', '-')} {value} is invalid: expected an integer >= {low}")
        if self.name == "prefix-repetition" and self.prefix_repetition_prefix_len + \
                self.prefix_repetition_suffix_len < 1:
            raise KestrelError("--prefix-repetition-prefix-len + --prefix-repetition-suffix-len is 0: "
                               "expected prompts of at least one token")

    def default_num(self) -> int | None:
        """shared-prefix has its own count (groups x prompts per group); the others take --num-prompts."""
        return self.num_groups * self.prompts_per_group if self.name == "shared-prefix" else None


def build_requests(cfg: DatasetConfig, num: int | None, input_len: int, output_len: int,
                   tokenizer: BenchTokenizer | None, seed: int, token_prompts: bool) -> list[BenchRequest]:
    """`num` requests of dataset `cfg.name` (None: a jsonl file's every line, else 200). input_len / output_len are the resolved defaults (flag or preset);
    token_prompts: random prompts may be token ids (the completions endpoint), else text."""
    rng = random.Random(seed)
    if cfg.name == "jsonl":
        return jsonl_requests(cfg.path, output_len, tokenizer, num)
    num = num or DEFAULT_NUM_PROMPTS
    if cfg.name == "fixed":
        return fixed_requests(output_len, num)
    if cfg.name == "sharegpt":
        return sharegpt_requests(cfg.path, num, cfg.sharegpt_output_len, tokenizer, rng)
    maker = PromptMaker(tokenizer, rng, token_prompts)
    if cfg.name == "prefix-repetition":
        return maker.prefix_repetition(num, cfg.prefix_repetition_num_prefixes, cfg.prefix_repetition_prefix_len,
                                       cfg.prefix_repetition_suffix_len,
                                       cfg.prefix_repetition_output_len or output_len)
    if cfg.name == "shared-prefix":
        return maker.prefix_repetition(num, cfg.num_groups, cfg.prefix_len, cfg.suffix_len, output_len)
    return maker.random(num, input_len, output_len, cfg.range_ratio)


def fixed_requests(output_len: int, num: int | None = None) -> list[BenchRequest]:
    """The 3 fixed prompts, cycled to `num` requests (default 3)."""
    num = len(FIXED_PROMPTS) if num is None else num
    return [BenchRequest(p, len(p.split()), output_len) for p in (FIXED_PROMPTS[i % 3] for i in range(num))]


def _length(rng: random.Random, mean: int, range_ratio: float) -> int:
    # vLLM's bounds: floor(len * (1 - r)) .. ceil(len * (1 + r)), at least 1
    low, high = int(mean * (1 - range_ratio)), math.ceil(mean * (1 + range_ratio))
    return max(1, rng.randint(low, max(low, high)))


class PromptMaker:
    """Random prompts of exact lengths from units: token ids of the tokenizer, or common words without one."""

    def __init__(self, tokenizer: BenchTokenizer | None, rng: random.Random, token_prompts: bool) -> None:
        self.tokenizer = tokenizer
        self.rng = rng
        self.token_prompts = token_prompts
        self.pool: list[int] | list[str] = tokenizer.prompt_token_ids if tokenizer else _WORDS

    def units(self, n: int) -> list:
        return [self.rng.choice(self.pool) for _ in range(n)]

    def heads(self, num: int) -> list[list]:
        """`num` distinct random first chunks of HEAD_LEN units."""
        seen: set[tuple] = set()
        out: list[list] = []
        while len(out) < num:
            head = tuple(self.units(HEAD_LEN))
            if head not in seen:
                seen.add(head)
                out.append(list(head))
        return out

    def request(self, units: list, output_len: int, keep: int = HEAD_LEN) -> BenchRequest:
        if self.tokenizer is None:
            return BenchRequest(" ".join(units), len(units), output_len)
        if self.token_prompts:
            return BenchRequest(list(units), len(units), output_len)
        text, length = self.tokenizer.text_of_length(list(units), self.rng, keep)
        return BenchRequest(text, length, output_len)

    def random(self, num: int, input_len: int, output_len: int, range_ratio: float) -> list[BenchRequest]:
        """Prompts of input_len tokens and outputs of output_len tokens, each uniform in len*(1 +- ratio)."""
        out = []
        for head in self.heads(num):
            length = _length(self.rng, input_len, range_ratio)
            units = (head + self.units(max(0, length - HEAD_LEN)))[:length]
            out.append(self.request(units, _length(self.rng, output_len, range_ratio)))
        return out

    def prefix_repetition(self, num: int, num_prefixes: int, prefix_len: int, suffix_len: int,
                          output_len: int) -> list[BenchRequest]:
        """`num_prefixes` random prefixes of prefix_len tokens, prompt i on prefix i % num_prefixes, each with its
        own random suffix of suffix_len tokens; shuffled (as vLLM and SGLang do) so the cache sees them
        interleaved."""
        prefixes = [self.units(prefix_len) for _ in range(num_prefixes)]
        out = []
        for i, head in enumerate(self.heads(num)):
            suffix = (head + self.units(max(0, suffix_len - HEAD_LEN)))[:suffix_len]
            out.append(self.request(prefixes[i % num_prefixes] + suffix, output_len, prefix_len + len(head)))
        self.rng.shuffle(out)
        return out


def _count(text: str, tokenizer: BenchTokenizer | None) -> int:
    return tokenizer.count(text) if tokenizer else len(text.split())


def _read_records(path: str) -> list:
    """A JSON list, or JSON Lines (one object per line)."""
    file = Path(path)
    if not file.is_file():
        raise KestrelError(f"--dataset-path {path!r} is invalid: no such file")
    text = file.read_text()
    try:
        data = json.loads(text)
        return data if isinstance(data, list) else [data]
    except ValueError:
        pass
    rows = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except ValueError as exc:
                raise KestrelError(f"{path}:{lineno} is not JSON ({exc}): expected a JSON list or one JSON "
                                   "object per line") from exc
    return rows


def _turn_text(turn: object) -> str:
    if not isinstance(turn, dict):
        return ""
    value = turn.get("value", turn.get("content"))
    return value if isinstance(value, str) else ""


def sharegpt_requests(path: str, num: int, output_len: int | None, tokenizer: BenchTokenizer | None,
                      rng: random.Random) -> list[BenchRequest]:
    """ShareGPT conversations ({"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}, or
    "messages" with role/content): the first turn is the prompt, the second's length the output length
    (--sharegpt-output-len overrides it). Shuffled, filtered as vLLM does, cycled to `num`."""
    pairs = []
    for row in _read_records(path):
        turns = (row.get("conversations") or row.get("conversation") or row.get("messages")
                 if isinstance(row, dict) else None)
        if isinstance(turns, list) and len(turns) >= 2 and _turn_text(turns[0]) and _turn_text(turns[1]):
            pairs.append((_turn_text(turns[0]), _turn_text(turns[1])))
    rng.shuffle(pairs)
    out = []
    for prompt, reply in pairs:
        prompt_len = _count(prompt, tokenizer)
        length = output_len or _count(reply, tokenizer)
        if prompt_len < SHAREGPT_MIN_LEN or (output_len is None and length < SHAREGPT_MIN_LEN) or \
                prompt_len > SHAREGPT_MAX_PROMPT_LEN or prompt_len + length > SHAREGPT_MAX_TOTAL_LEN:
            continue
        out.append(BenchRequest(prompt, prompt_len, length))
        if len(out) == num:
            break
    if not out:
        raise KestrelError(f"--dataset-path {path!r} is invalid: no ShareGPT conversation with a prompt and a "
                           f"reply of {SHAREGPT_MIN_LEN}..{SHAREGPT_MAX_PROMPT_LEN} tokens in it")
    return [out[i % len(out)] for i in range(num)]


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
        out.append(BenchRequest(prompt, _count(prompt, tokenizer), length))
    if not out:
        raise KestrelError(f"--dataset-path {path!r} is invalid: no prompts in it")
    if num is not None:
        out = [out[i % len(out)] for i in range(num)]
    return out
