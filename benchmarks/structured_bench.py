"""Structured outputs' cost (issue 54): json_schema against unconstrained throughput at a fixed concurrency, one
engine, random weights in a real shape.

    python -m benchmarks.structured_bench --shape llama-3.1-8b --concurrency 32 --out structured.json     # GPU
    python -m benchmarks.structured_bench --smoke --out /tmp/structured.json                               # CPU, ~1 min

Closed loop, as `kestrel bench serve --max-concurrency` drives a server: CONCURRENCY requests in flight at all
times (a finished one is replaced at once) until REQUESTS have finished; output tokens / wall seconds.

Both modes do the same work. The json_schema round runs first (each request cycles through SCHEMAS, sampled at
--temperature, at most --output-len tokens: a random model closes a JSON value when it happens to draw the right
token, so lengths vary); the unconstrained round then gives request i exactly the length request i got
(`max_tokens` = that length, ignore_eos), on fresh prompts of the same length. What differs is the constraint
alone: the grammar compiled (cached after the warm-up round), its bitmask filled on the host each step and applied in
the sampler, the matcher advanced at commit, and the overlap schedule off for constrained rows (a row's next mask
needs its last token on the host). Rounds alternate (json, plain, json, plain, ...); the ratio is of the medians.

The vocabulary is byte-level BPE of the shape's size (256 bytes, every printable ASCII pair, then letter words with
and without a leading space): xgrammar's per-state masks and its compile time depend on what the tokens spell, and
the word-level tokenizer of benchmarks/shapes.py spells no JSON punctuation at all. Its merges are empty (prompts
are token ids; only decoding and the grammar read the vocabulary).

Reported: per round wall seconds, output tok/s, output tokens, finish reasons; for json_schema rounds the fraction
of outputs finished by the grammar whose text validates against its schema (must be 1.0); each schema's compile
time (first request, before the warm-up); `json_over_plain` (>= 0.95 is issue 54's bar on the 8B shape at 32).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections import deque
from pathlib import Path
from typing import Annotated, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from benchmarks.shapes import SHAPES, write_config_only


# ---- the schemas requests cycle through: what agents send (a tool call, a record, a plan) -----------------------
# Strings are bounded: a random model almost never draws the closing quote of an unbounded string (a handful of the
# vocabulary's tokens end one), so its outputs would all be the inside of the first string, cut by max_tokens.

class Arguments(BaseModel):
    model_config = ConfigDict(extra="forbid")
    query: str = Field(max_length=40)
    max_results: int = Field(ge=1, le=50)
    filters: list[Literal["news", "images", "video", "shopping"]] = Field(max_length=3)


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Literal["web_search", "read_page", "run_code", "send_mail"]
    arguments: Arguments


class Address(BaseModel):
    model_config = ConfigDict(extra="forbid")
    street: str = Field(max_length=24)
    city: str = Field(max_length=16)
    zip: str = Field(pattern=r"^[0-9]{5}$")


class Record(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: int = Field(ge=0, le=999999)
    title: str = Field(max_length=48)
    tags: list[Annotated[str, Field(max_length=12)]] = Field(max_length=5)
    rating: float = Field(ge=0, le=5)
    in_stock: bool
    address: Address


class Step(BaseModel):
    model_config = ConfigDict(extra="forbid")
    thought: str = Field(max_length=64)
    action: Literal["search", "read", "answer"]


class Plan(BaseModel):
    model_config = ConfigDict(extra="forbid")
    steps: list[Step] = Field(min_length=1, max_length=8)
    final: str = Field(max_length=64)


SCHEMAS: dict[str, type[BaseModel]] = {"tool_call": ToolCall, "record": Record, "plan": Plan}

# a CPU-sized llama (the 8B's architecture and rope), for --smoke
TINY = dict(SHAPES["llama-3.1-8b"], hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=4096, max_position_embeddings=2048)
SPECIALS = ("<s>", "</s>", "<unk>")   # ids 0, 1, 2: the shapes' bos_token_id / eos_token_id


# ---- the model directory --------------------------------------------------------------------------------------

def byte_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte, the alphabet byte-level BPE vocabularies are written in."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def bytelevel_pieces(vocab_size: int, seed: int = 0) -> list[str]:
    """vocab_size - len(SPECIALS) distinct token texts: the 256 bytes, every printable ASCII pair (shuffled, cut to
    fit a small vocabulary), then lowercase / capitalised words of 2-10 letters, half with a leading space."""
    rng = random.Random(seed)
    want = vocab_size - len(SPECIALS)
    pieces: list[str] = [bytes([b]).decode("latin-1") for b in range(256)]
    seen = set(pieces)
    printable = [chr(c) for c in range(32, 127)]
    pairs = [a + b for a in printable for b in printable]
    rng.shuffle(pairs)
    for p in pairs[:max(0, min(len(pairs), (want - len(pieces)) // 2))]:
        if p not in seen:
            pieces.append(p)
            seen.add(p)
    letters = "abcdefghijklmnopqrstuvwxyz"
    while len(pieces) < want:
        word = "".join(rng.choice(letters) for _ in range(rng.randint(2, 10)))
        word = word.capitalize() if rng.random() < 0.1 else word
        word = " " + word if rng.random() < 0.5 else word
        if word not in seen:
            pieces.append(word)
            seen.add(word)
    return pieces[:want]


def write_bytelevel_tokenizer(out: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    table = byte_to_unicode()
    vocab = {name: i for i, name in enumerate(SPECIALS)}
    for piece in bytelevel_pieces(vocab_size):
        vocab["".join(table[b] for b in piece.encode("latin-1" if len(piece) == 1 else "utf-8"))] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=SPECIALS[0], eos_token=SPECIALS[1],
                                   unk_token=SPECIALS[2])
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    fast.save_pretrained(str(out))


def model_dir(shape: str, workdir: Path) -> tuple[Path, int]:
    """config.json (the shape's, or TINY) and the byte-level tokenizer: what `--load-format dummy` needs."""
    out = workdir / f"{shape}-dummy-bytelevel"
    if shape == "tiny":
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(TINY, indent=1))
        vocab = TINY["vocab_size"]
    else:
        write_config_only(shape, out)
        vocab = SHAPES[shape]["vocab_size"]
    write_bytelevel_tokenizer(out, vocab)   # replaces the word-level tokenizer
    return out, vocab


# ---- one round ------------------------------------------------------------------------------------------------

def closed_loop(engine, prompts: list[list[int]], params: list, concurrency: int, tag: str) -> dict:
    """Every prompt through the engine with `concurrency` in flight; output token ids and finish reasons back."""
    n = len(prompts)
    outputs: list[list[int]] = [[] for _ in range(n)]
    reasons: list[str | None] = [None] * n
    queue, in_flight = deque(range(n)), 0

    def add() -> None:
        nonlocal in_flight
        i = queue.popleft()
        engine.add_request(f"{tag}-{i}", prompts[i], params[i])
        in_flight += 1

    t0 = time.perf_counter()
    while queue and in_flight < concurrency:
        add()
    steps = 0
    while in_flight:
        for u in engine.step():
            i = int(u.request_id.rsplit("-", 1)[1])
            outputs[i].extend(u.new_token_ids)
            if u.finished:
                reasons[i] = u.finish_reason
                in_flight -= 1
                if queue:
                    add()
        steps += 1
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    tokens = sum(len(o) for o in outputs)
    return {"wall_s": wall, "steps": steps, "output_tokens": tokens, "output_tok_s": tokens / wall,
            "finish_reasons": {r: reasons.count(r) for r in sorted(set(map(str, reasons)))},
            "_outputs": outputs, "_reasons": reasons}


def schema_checks(engine, names: list[str], outputs: list[list[int]], reasons: list[str | None]) -> dict:
    """Outputs the grammar ended (finish "stop"): the fraction whose text validates against its schema."""
    ended = [(name, ids) for name, ids, r in zip(names, outputs, reasons) if r == "stop"]
    valid = 0
    for name, ids in ended:
        try:
            SCHEMAS[name].model_validate_json(engine.tokenizer.decode(ids), strict=True)
            valid += 1
        except ValueError:
            pass
    return {"ended_by_grammar": len(ended), "valid_fraction": valid / len(ended) if ended else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES) + ["tiny"])
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--requests", type=int, default=256, help="requests per round")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=256, help="max_tokens of a json_schema request")
    ap.add_argument("--temperature", type=float, default=1.0, help="kestrel bench serve's default (sampled rows)")
    ap.add_argument("--rounds", type=int, default=3, help="json_schema / unconstrained pairs, after a warm-up pair")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--workdir", default="/tmp/kestrel-bench")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU, a tiny llama, a few short requests: checks the whole road in about a minute")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.smoke:
        args.shape, args.device, args.dtype = "tiny", "cpu", "float32"
        args.concurrency, args.requests, args.prompt_len, args.output_len, args.rounds = 4, 8, 16, 160, 1
    from kestrel.bench.fresh import FreshPrompts
    from kestrel.config import EngineConfig
    from kestrel.engine.engine import Engine
    from kestrel.sampling_params import SamplingParams, StructuredOutput

    path, vocab = model_dir(args.shape, Path(args.workdir))
    t0 = time.perf_counter()
    engine = Engine(EngineConfig(model=str(path), device=args.device, dtype=args.dtype, load_format="dummy",
                                 max_num_seqs=max(256, args.concurrency)))
    report: dict = {"shape": args.shape, "concurrency": args.concurrency, "requests": args.requests,
                    "prompt_len": args.prompt_len, "output_len": args.output_len, "temperature": args.temperature,
                    "vocab_size": vocab, "startup_s": time.perf_counter() - t0, "torch": torch.__version__,
                    "date": time.strftime("%Y-%m-%d"), "smoke": args.smoke,
                    "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None}
    constraints = {name: StructuredOutput(json_schema=json.dumps(model.model_json_schema()))
                   for name, model in SCHEMAS.items()}
    report["compile_s"] = {}
    for name, so in constraints.items():   # the first request of each schema pays this; later ones hit the cache
        t = time.perf_counter()
        engine.grammar_compiler.compile(so)
        report["compile_s"][name] = time.perf_counter() - t
    names = [list(SCHEMAS)[i % len(SCHEMAS)] for i in range(args.requests)]
    fresh = FreshPrompts(vocab, low=len(SPECIALS))

    def pair(tag: str) -> tuple[dict, dict]:
        json_params = [SamplingParams(max_tokens=args.output_len, temperature=args.temperature,
                                      structured_output=constraints[name]) for name in names]
        constrained = closed_loop(engine, fresh.take(args.requests, args.prompt_len), json_params,
                                  args.concurrency, f"{tag}j")
        constrained.update(schema_checks(engine, names, constrained["_outputs"], constrained["_reasons"]))
        plain_params = [SamplingParams(max_tokens=max(1, len(o)), temperature=args.temperature, ignore_eos=True)
                        for o in constrained["_outputs"]]
        plain = closed_loop(engine, fresh.take(args.requests, args.prompt_len), plain_params, args.concurrency,
                            f"{tag}p")
        for r in (constrained, plain):
            del r["_outputs"], r["_reasons"]
        return constrained, plain

    pair("warm")   # kernels built, CUDA graphs captured, grammars compiled: none of that is measured
    rounds = [pair(f"r{k}") for k in range(args.rounds)]
    report["json_schema"] = [c for c, _ in rounds]
    report["unconstrained"] = [p for _, p in rounds]
    json_tok_s = statistics.median(c["output_tok_s"] for c, _ in rounds)
    plain_tok_s = statistics.median(p["output_tok_s"] for _, p in rounds)
    report["json_over_plain"] = json_tok_s / plain_tok_s
    valid = [c["valid_fraction"] for c, _ in rounds if c["valid_fraction"] is not None]
    report["valid_fraction"] = min(valid) if valid else None
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"{args.shape} c{args.concurrency} on {report['gpu'] or 'cpu'}: json_schema {json_tok_s:.0f} tok/s, "
          f"unconstrained {plain_tok_s:.0f} tok/s, ratio {report['json_over_plain']:.3f}; schemas valid "
          f"{report['valid_fraction']}; compile " + ", ".join(f"{k} {v * 1e3:.0f} ms"
                                                               for k, v in report["compile_s"].items()))
    return 0 if report["valid_fraction"] in (None, 1.0) else 1


if __name__ == "__main__":
    sys.exit(main())
