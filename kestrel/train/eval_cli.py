"""`kestrel eval-drafter`: acceptance of a drafter (or n-gram) for a target on held-out prompts, greedy, through
the serving path."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from kestrel.errors import KestrelError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval-drafter", help="acceptance rate and length of a drafter on held-out prompts",
                       description="Generate greedily with speculation at a fixed depth on held-out prompts and "
                                   "report acceptance rate, acceptance length and per-position acceptance.")
    p.add_argument("--target", "--model", dest="target", default=None,
                   help="target checkpoint directory, .gguf file or short name (default: the default model)")
    p.add_argument("--draft", default=None,
                   help="EAGLE-3 drafter directory (method eagle3; the default model's own when measuring it)")
    p.add_argument("--method", default="eagle3", choices=["eagle3", "ngram"], help="what drafts")
    p.add_argument("--data", default=None,
                   help="JSONL prompts (as train-eagle3 reads them; default: instructions on held-out topics)")
    p.add_argument("--prompts", type=int, default=32, help="prompts measured")
    p.add_argument("--num-speculative-tokens", "-k", type=int, default=3, help="K, drafting steps")
    p.add_argument("--topk", type=int, default=1, help="candidates per step (1: a chain, more: a tree)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="tokens generated per prompt")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--seed", type=int, default=0, help="which held-out instructions are drawn")
    p.add_argument("--out", default=None, help="write the figures as JSON here")


def run(args: argparse.Namespace) -> int:
    if args.data is not None and not Path(args.data).is_file():
        raise KestrelError(f"{args.data} not found")
    from kestrel.train.data import instruction_prompts, load_prompts
    from kestrel.train.evaluate import evaluate_drafter
    from kestrel.train.prompts import held_out_prompts

    if args.data is not None:
        prompts = load_prompts(args.data)[:args.prompts]
    else:
        prompts = instruction_prompts(held_out_prompts(args.prompts, args.seed))
    ev = evaluate_drafter(args.target, prompts, args.draft, method=args.method,
                          num_speculative_tokens=args.num_speculative_tokens, topk=args.topk,
                          max_new_tokens=args.max_new_tokens, device=args.device)
    print(ev.summary())
    if args.out:
        Path(args.out).write_text(json.dumps(ev.as_dict(), indent=2))
    return 0
