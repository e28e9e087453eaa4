"""`kestrel generate`: offline generation, streaming text to stdout as it is produced."""
from __future__ import annotations

import argparse
import sys

from kestrel.config import add_engine_args, engine_kwargs
from kestrel.sampling_params import SamplingParams


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text offline (default model when no --model)")
    add_engine_args(p)
    p.add_argument("--prompt", action="append", required=True, help="prompt text; repeat for a batch")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens to generate per sample at most")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the smallest set of tokens "
                   "whose probability reaches P (1: off)")
    p.add_argument("--top-k", type=int, default=-1, help="keep the K most likely tokens (-1: off)")
    p.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens less likely than P times the most likely one (0: off)")
    p.add_argument("--n", type=int, default=1, help="samples per prompt")
    p.add_argument("--stop", action="append", default=[], help="stop string; repeat for several (default: none)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")

def run(args: argparse.Namespace) -> int:
    from kestrel.llm import LLM

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, min_p=args.min_p, seed=args.seed, n=args.n, stop=args.stop,
                            ignore_eos=args.ignore_eos)
    llm = LLM(**engine_kwargs(args))   # builds the config, fetching Hub ids once
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]) if args.chat else p
               for p in args.prompt]
    streamed = len(prompts) == 1 and args.n == 1
    if streamed:
        sys.stdout.write(args.prompt[0] if not args.chat else "")
        sys.stdout.flush()

    def on_text(req: int, sample: int, delta: str) -> None:
        if streamed:
            sys.stdout.write(delta)
            sys.stdout.flush()

    outputs = llm.generate(prompts, params, on_text=on_text)
    if streamed:
        sys.stdout.write("\n")
    else:
        for i, out in enumerate(outputs):
            for sample in out.outputs:
                print(f"--- prompt {i} sample {sample.index} ({sample.finish_reason}) ---")
                print(args.prompt[i] + sample.text if not args.chat else sample.text)
    for i, out in enumerate(outputs):
        m = out.metrics
        n_tok = sum(len(s.token_ids) for s in out.outputs)
        print(f"[prompt {i}: {len(out.prompt_token_ids)} prompt tokens, {n_tok} generated, "
              f"TTFT {1000 * (m.ttft_s or 0):.1f} ms, total {m.e2e_s or 0:.2f} s]", file=sys.stderr)
    return 0
