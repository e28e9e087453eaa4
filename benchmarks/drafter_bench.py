"""A trained drafter on a real target: acceptance and bs1 decode speed on held-out prompts, greedy.

    offline (one process, LLM.generate, prompts one at a time):
        none | EAGLE-3 chain K fixed | EAGLE-3 chain K adaptive | EAGLE-3 tree K x topk fixed | n-gram K fixed
        each: decode tok/s, acceptance length, acceptance rate, per-position acceptance
    through `kestrel serve` (--serve), one stream of the same prompts as chat requests: none vs EAGLE-3 chain
        (the default adaptive policy), measured by `kestrel bench serve`

The prompts are instructions on topics kept out of training (kestrel/train/prompts.py), through the target's chat
template. Every offline run generates the same number of tokens a prompt, so a speed ratio compares the same work:
by default (--lengths matched) the run without speculation answers to EOS (at most --output-len tokens), as a
user's would, and every speculative run generates exactly as many tokens a prompt (ignore_eos); --lengths
ignore-eos: every run generates --output-len tokens a prompt. Each row has its output token counts and the timed
prompts' prefix-cache hit rate (the prompts share the chat template's head; the warm-up shares nothing with them).

    python -m benchmarks.drafter_bench --target smollm2 --drafter DIR --out drafter.json [--serve]
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from kestrel.bench.fresh import FreshPrompts, hit_rate_fields
from kestrel.llm import LLM
from kestrel.sampling_params import SamplingParams
from kestrel.train.data import Prompt, instruction_prompts, load_prompts
from kestrel.train.prompts import held_out_prompts
from kestrel.train.target import Target

log = logging.getLogger("drafter_bench")


def bs1(llm: LLM, prompts: list[list[int]], output_len: int, lengths: list[int] | None = None) -> dict:
    """Prompts one at a time; decode tok/s = tokens after the first / time after the first token.

    lengths None: each answer ends at EOS (at most output_len tokens), as a user's would; otherwise prompt i
    generates exactly lengths[i] tokens (ignore_eos), so runs given the same lengths do the same work. The warm-up
    is a random prompt of the first one's length that shares no prefix with any timed prompt; the timed prompts'
    prefix-cache hit rate is in the row (they share the chat template's head, so it is not zero)."""
    if lengths is None:
        params = [SamplingParams(max_tokens=output_len, temperature=0.0)] * len(prompts)
    else:
        params = [SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0.0) for n in lengths]
    vocab = llm.engine.runner.cfg.vocab_size
    warm = FreshPrompts(vocab, seed=1, avoid={p[0] for p in prompts if p}).one(len(prompts[0]))
    llm.generate([warm], SamplingParams(max_tokens=8, temperature=0.0))   # warm
    before = llm.engine.stats()
    tokens, decode_s, wall, per_prompt = 0, 0.0, 0.0, []
    for p, sp in zip(prompts, params):
        t0 = time.perf_counter()
        out = llm.generate([p], sp)[0]
        wall += time.perf_counter() - t0
        n = len(out.outputs[0].token_ids)
        tokens += n
        per_prompt.append(n)
        m = out.metrics
        decode_s += m.finished_time - m.first_token_time
    after = llm.engine.stats()
    row: dict[str, Any] = {"output_tokens": tokens, "output_tokens_per_prompt": per_prompt, "wall_s": wall,
                           "decode_tok_s": (tokens - len(prompts)) / decode_s if decode_s else None,
                           "ignore_eos": lengths is not None,
                           **hit_rate_fields((before.prefix_cache_queries, before.prefix_cache_hits),
                                             (after.prefix_cache_queries, after.prefix_cache_hits))}
    if after.spec_num_drafts:
        steps = after.spec_num_drafts - before.spec_num_drafts
        drafted = after.spec_num_draft_tokens - before.spec_num_draft_tokens
        accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
        per_pos = [a - (before.spec_accepted_per_pos[i] if i < len(before.spec_accepted_per_pos) else 0)
                   for i, a in enumerate(after.spec_accepted_per_pos)]
        row.update(verify_steps=steps, acceptance_rate=accepted / drafted if drafted else None,
                   acceptance_length=1 + accepted / steps if steps else None,
                   per_position=[round(a / steps, 3) for a in per_pos] if steps else [])
    return row


LENGTHS = ("matched", "ignore-eos")


def offline(target: str | None, drafter: str, k: int, topk: int, prompts_in: list[Prompt], output_len: int,
            device: str | None = None, lengths: str = "matched", only: tuple[str, ...] | None = None) -> dict:
    """Every run on the same prompts, with the same output tokens a prompt (the speed ratio compares the same
    work): lengths "matched" (default): the first run (no speculation) answers to EOS, as a user's would, and
    every other run generates exactly as many tokens a prompt (ignore_eos); "ignore-eos": every run generates
    output_len tokens a prompt. only: the run labels to keep (tests)."""
    if lengths not in LENGTHS:
        raise ValueError(f"lengths {lengths!r}: expected one of {LENGTHS}")
    runs = {"none": None,
            f"eagle3_chain_k{k}": {"method": "eagle3", "model": drafter, "num_speculative_tokens": k,
                                   "adaptive": False},
            f"eagle3_chain_k{k}_adaptive": {"method": "eagle3", "model": drafter, "num_speculative_tokens": k},
            f"eagle3_tree_k{k}x{topk}": {"method": "eagle3", "model": drafter, "num_speculative_tokens": k,
                                         "topk": topk, "adaptive": False},
            f"ngram_k{k}": {"method": "ngram", "num_speculative_tokens": k, "adaptive": False}}
    if only is not None:
        runs = {label: spec for label, spec in runs.items() if label in only or label == "none"}
    out = {}
    per_prompt: list[int] | None = None
    for label, spec in runs.items():
        t0 = time.perf_counter()
        llm = LLM(target, speculative_config=spec, cuda_graph_max_bs=8, **({"device": device} if device else {}))
        startup = time.perf_counter() - t0
        prompts = [Target(llm).prompt_ids(p) for p in prompts_in]
        if lengths == "ignore-eos":
            per_prompt = [output_len] * len(prompts)
        out[label] = {"startup_s": startup, **bs1(llm, prompts, output_len, per_prompt)}
        if per_prompt is None:   # the reference run's natural lengths: every later run generates as many
            per_prompt = out[label]["output_tokens_per_prompt"]
        log.info("%s: %s", label, out[label])
        llm.shutdown()
        del llm
        gc.collect()
    return out


def serve(target: str | None, drafter: str, k: int, prompts_in: list[Prompt], output_len: int, raw: Path) -> dict:
    """One stream through `kestrel serve` + `kestrel bench serve` (chat endpoint, the held-out prompts), output_len
    tokens a request (ignore_eos: both servers do the same work); bench serve reports each run's prefix-cache hit
    rate."""
    data = raw / "held_out_prompts.jsonl"
    turns = [p.messages[-1]["content"] if p.messages else p.text for p in prompts_in]
    data.write_text("".join(json.dumps({"conversations": [{"from": "human", "value": t}, {"from": "gpt", "value": "x"}]})
                            + "\n" for t in turns))
    out = {}
    for label, extra in (("none", []), (f"eagle3_k{k}", ["--speculative-algorithm", "EAGLE3",
                                                         "--speculative-draft-model-path", drafter,
                                                         "--speculative-num-steps", str(k)])):
        result = raw / f"drafter_serve_{label}.json"
        bench = (f"{sys.executable} -m kestrel.cli bench serve --base-url {{base_url}} --endpoint chat "
                 f"--dataset-name sharegpt --dataset-path {data} --sharegpt-output-len {output_len} "
                 f"--num-prompts {len(prompts_in)} --concurrency 1 --label {label} "
                 f"--no-progress --output {result}")
        cmd = [sys.executable, "-m", "kestrel.cli", "launch", "--name", f"drafter-{label}", "--port", "8014",
               "--ready-timeout", "300", "--stall-timeout", "60", "--then", bench, "--",
               sys.executable, "-m", "kestrel.cli", "serve", *([target] if target else []), "--port", "8014", *extra]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=420)
        if proc.returncode != 0 or not result.exists():
            out[label] = {"error": (proc.stdout + proc.stderr)[-1500:]}
            continue
        out[label] = json.loads(result.read_text())
    return out


def summary(r: dict) -> str:
    lines = [f"trained drafter · {r['gpu']} · {r['target']} · {r['prompts']} held-out prompts · {r['date']}", "",
             "| run | acceptance length | rate | per position | bs1 decode tok/s | vs none |",
             "|---|---:|---:|---|---:|---:|"]
    base = r["offline"]["none"]["decode_tok_s"]
    for label, row in r["offline"].items():
        al = row.get("acceptance_length")
        lines.append(f"| {label} | {al:.2f} | {row['acceptance_rate']:.2f} | {row['per_position']} | "
                     f"{row['decode_tok_s']:.1f} | {row['decode_tok_s'] / base:.2f}x |" if al else
                     f"| {label} | — | — | — | {row['decode_tok_s']:.1f} | {row['decode_tok_s'] / base:.2f}x |")
    counts = ", ".join(f"{label} {row.get('output_tokens')}" for label, row in r["offline"].items())
    hits = ", ".join(f"{label} {row['prefix_cache_hit_rate']:.2f}" for label, row in r["offline"].items()
                     if row.get("prefix_cache_hit_rate") is not None)
    lines += ["", f"output tokens a run ({r.get('lengths', 'natural')} lengths): {counts}",
              f"prefix-cache hit rate of the timed prompts: {hits or 'n/a'}"]
    srv = r.get("serve")
    if srv:
        def tps(x: dict) -> float | None:
            try:
                return x["runs"][0]["summary"]["output_throughput"]
            except (KeyError, IndexError, TypeError):
                return None
        got = {label: tps(x) for label, x in srv.items()}
        base_s = got.get("none")
        parts = [f"{label} {v:.1f} tok/s" + (f" ({v / base_s:.2f}x)" if base_s and v else "")
                 if v else f"{label} failed: {str(srv[label].get('error', '?'))[-300:]}" for label, v in got.items()]
        lines += ["", "through kestrel serve, one stream: " + ", ".join(parts)]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None, help="default: the default model")
    ap.add_argument("--data", help="held-out prompts JSONL (default: instructions on held-out topics)")
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--lengths", choices=LENGTHS, default="matched",
                    help="output tokens a prompt: matched (the no-speculation run's EOS lengths, for every run) or "
                    "ignore-eos (--output-len for every run)")
    ap.add_argument("--serve", action="store_true")
    ap.add_argument("--serve-only", action="store_true")
    ap.add_argument("--device", default=None, help="default: cuda when there is one")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    prompts = load_prompts(args.data)[:args.prompts] if args.data else \
        instruction_prompts(held_out_prompts(args.prompts, seed=1))
    r: dict[str, Any] = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                         "target": args.target or "kestrel-tiny", "drafter": args.drafter, "k": args.k, "topk": args.topk,
                         "prompts": len(prompts), "output_len": args.output_len, "lengths": args.lengths,
                         "date": time.strftime("%Y-%m-%d")}
    if not args.serve_only:
        r["offline"] = offline(args.target, args.drafter, args.k, args.topk, prompts, args.output_len, args.device,
                               args.lengths)
        Path(args.out).write_text(json.dumps(r, indent=1))
    if args.serve or args.serve_only:
        r["serve"] = serve(args.target, args.drafter, args.k, prompts, args.output_len, Path(args.out).parent)
        Path(args.out).write_text(json.dumps(r, indent=1))
    if "offline" in r:
        print(summary(r))
    else:
        print(json.dumps(r.get("serve"), indent=1)[:3000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
