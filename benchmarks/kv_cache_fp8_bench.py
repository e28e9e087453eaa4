"""--kv-cache-dtype fp8 against the model-dtype (bf16) cache on one GPU: capacity, and throughput at 128 concurrent.

For each cache dtype, one engine (random weights in a real shape, benchmarks/shapes.py; CUDA graphs and the triton
backend, the server's defaults) reports:

    capacity      KV blocks and tokens the --gpu-memory-utilization budget holds (fp8: one byte an element)
    default       output tok/s of 128 requests submitted at once, 128 prompt tokens and 256 output tokens each
                  (ignore_eos), with the whole budget: both caches hold them all, so this is the read cost of FP8
    tight         the same 128 requests with --kv-cache-memory sized for half of them in bf16 (64 x 384 tokens):
                  bf16 preempts and recomputes, fp8 holds all 128 (the capacity gain as throughput)

    python -m benchmarks.kv_cache_fp8_bench --model qwen3-0.6b --out kv_fp8.json
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.shapes import SHAPES, write_random_checkpoint
from kestrel.engine.engine import Engine
from kestrel.forward.runner import kv_bytes_per_block
from kestrel.llm import LLM
from kestrel.sampling_params import SamplingParams

log = logging.getLogger("bench")
PROMPT_LEN, OUTPUT_LEN = 128, 256


def prompts(count: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (count, PROMPT_LEN), generator=gen).tolist()


def run_all_at_once(engine: Engine, batch: list[list[int]]) -> dict:
    params = SamplingParams(max_tokens=OUTPUT_LEN, temperature=0.0, ignore_eos=True)
    preempted = engine.scheduler.num_preemptions
    start = time.perf_counter()
    for i, p in enumerate(batch):
        engine.add_request(f"r{i}-{start}", p, params)
    tokens = 0
    while engine.has_unfinished():
        tokens += sum(len(up.new_token_ids) for up in engine.step())
    wall = time.perf_counter() - start
    return {"output_tok_s": tokens / wall, "wall_s": wall, "output_tokens": tokens,
            "preemptions": engine.scheduler.num_preemptions - preempted}


def bench_one(model_dir: Path, kv_cache_dtype: str, concurrency: int, tight_bytes: int | None, vocab: int) -> dict:
    options = dict(model=str(model_dir), kv_cache_dtype=kv_cache_dtype, max_num_seqs=concurrency,
                   cuda_graph_max_bs=concurrency)
    if tight_bytes is not None:
        options["kv_cache_memory"] = tight_bytes
    llm = LLM(**options)
    engine = llm.engine
    try:
        run_all_at_once(engine, prompts(8, vocab, seed=99))   # warm-up: first launches, allocator
        result = {"kv_blocks": engine.pool.num_blocks, "kv_tokens": engine.pool.num_blocks * engine.pool.block_size,
                  "kv_dtype": str(engine.runner.kv_cache.dtype).removeprefix("torch."),
                  "kv_gb": engine.runner.kv_cache.nbytes / 1e9}
        result.update(run_all_at_once(engine, prompts(concurrency, vocab, seed=1)))
        return result
    finally:
        llm.shutdown()   # the next engine gets the whole GPU


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b", choices=sorted(SHAPES))
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--out", default="kv_cache_fp8.json")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="kestrel-kvfp8-"))
    model_dir = write_random_checkpoint(args.model, workdir / args.model)
    vocab = SHAPES[args.model]["vocab_size"]
    from kestrel.models.checkpoint import load_model_config
    cfg = load_model_config(model_dir)
    half = args.concurrency // 2 * -(-(PROMPT_LEN + OUTPUT_LEN) // 16)   # blocks of half the requests, bf16
    tight = half * kv_bytes_per_block(cfg, 16, torch.bfloat16)
    report = {"gpu": torch.cuda.get_device_name(), "model": args.model, "concurrency": args.concurrency,
              "prompt_len": PROMPT_LEN, "output_len": OUTPUT_LEN, "tight_kv_bytes": tight, "runs": {}}
    for budget, label in ((None, "default"), (tight, "tight")):
        for dtype in ("auto", "fp8"):
            name = f"{label}/{dtype}"
            try:
                report["runs"][name] = bench_one(model_dir, dtype, args.concurrency, budget, vocab)
            except Exception as exc:   # one failed run still leaves the others' figures
                log.exception("%s failed", name)
                report["runs"][name] = {"error": repr(exc)[:500]}
            log.info("%s: %s", name, report["runs"][name])
            Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
