"""How closely an FP8 model follows its bf16 original: top-1 agreement and KL over real text positions.

    python -m benchmarks.fp8_agreement [--model smollm2] [--device cpu|cuda] [--quantization fp8|fp8-per-tensor]
                                      [--prompts N] [--max-tokens T] [--out FILE]

The bf16 model answers held-out instructions (greedy, its own chat template); each prompt + answer is then scored
by both models at every position (`Engine.prompt_logits`, one forward pass each), and over all positions:

    top-1 agreement   fraction of positions where argmax(logits_fp8) == argmax(logits_bf16)
    KL                mean over positions of KL(p_bf16 || p_fp8), nats (float32 softmax of each model's logits)
    greedy match      fraction of the bf16 answers' tokens that the FP8 model's greedy answer reproduces before
                      its first divergence, per prompt, averaged

On the CPU the FP8 weights are dequantized per call (W = w8 * scale, the same values the CUDA kernels multiply),
so the figures measure the quantization itself; on CUDA they include the kernels' accumulation order too.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

from kestrel import LLM, SamplingParams
from kestrel.train.prompts import held_out_prompts


def answers(llm: LLM, prompts: list[str], max_tokens: int) -> tuple[list[list[int]], list[list[int]]]:
    """(chat-templated prompt ids, greedy answer ids) per prompt."""
    ids = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    outs = llm.generate([{"prompt_token_ids": i} for i in ids], SamplingParams(max_tokens=max_tokens, temperature=0))
    return ids, [list(o.outputs[0].token_ids) for o in outs]


def scores(llm: LLM, sequences: list[list[int]]) -> list[torch.Tensor]:
    """Float32 logits [T, vocab] at every position of each sequence."""
    return [llm.engine.prompt_logits(seq).float().cpu() for seq in sequences]


def compare(ref: list[torch.Tensor], test: list[torch.Tensor], starts: list[int]) -> dict:
    """Agreement over the answer positions (from each prompt's last token on: where the answer is predicted)."""
    agree = total = 0
    kl_sum = 0.0
    for r, t, s in zip(ref, test, starts):
        r, t = r[s - 1:-1], t[s - 1:-1]
        agree += int((r.argmax(-1) == t.argmax(-1)).sum())
        total += r.shape[0]
        logp, logq = torch.log_softmax(r, -1), torch.log_softmax(t, -1)
        kl_sum += float((logp.exp() * (logp - logq)).sum())
    return {"positions": total, "top1_agreement": agree / total, "kl_mean_nats": kl_sum / total}


def greedy_match(ref: list[list[int]], test: list[list[int]]) -> float:
    fractions = []
    for a, b in zip(ref, test):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        fractions.append(n / max(1, len(a)))
    return sum(fractions) / len(fractions)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--quantization", default="fp8", choices=["fp8", "fp8-per-tensor"])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    prompts = held_out_prompts(args.prompts)
    common = dict(device=args.device, dtype="bfloat16", disable_prefix_cache=True)
    t0 = time.perf_counter()
    ref_llm = LLM(model=args.model, **common)
    prompt_ids, ref_answers = answers(ref_llm, prompts, args.max_tokens)
    sequences = [p + a for p, a in zip(prompt_ids, ref_answers)]
    ref_logits = scores(ref_llm, sequences)
    ref_llm.shutdown()
    del ref_llm
    fp8_llm = LLM(model=args.model, quantization=args.quantization, **common)
    _, fp8_answers = answers(fp8_llm, prompts, args.max_tokens)
    fp8_logits = scores(fp8_llm, sequences)
    fp8_llm.shutdown()
    result = {"model": args.model, "device": args.device, "quantization": args.quantization,
              "prompts": len(prompts), "max_tokens": args.max_tokens,
              **compare(ref_logits, fp8_logits, [len(p) for p in prompt_ids]),
              "greedy_prefix_match": greedy_match(ref_answers, fp8_answers),
              "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
              "date": datetime.date.today().isoformat(), "seconds": round(time.perf_counter() - t0, 1)}
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
