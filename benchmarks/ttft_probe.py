"""Quick probe: TTFT of one 128-token prompt and bs1 decode, with prefill graphs on and off (one model shape).

    python -m benchmarks.ttft_probe --model qwen3-0.6b --out ttft.json
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from benchmarks.engine_bench import random_prompts, run_requests, single_stream
from benchmarks.shapes import SHAPES, write_random_checkpoint
from kestrel.config import EngineConfig
from kestrel.engine.engine import Engine


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--out", default="ttft.json")
    args = ap.parse_args()
    vocab = SHAPES[args.model]["vocab_size"]
    path = write_random_checkpoint(args.model, Path(tempfile.mkdtemp()) / args.model)
    engine = Engine(EngineConfig(model=str(path), device="cuda", cuda_graph_max_bs=8, max_num_seqs=8))
    one = random_prompts(1, 128, vocab, 1)
    run_requests(engine, one, 4)
    res = {"model": args.model, "prefill_graphs": engine.runner.prefill_graphs is not None}
    res["ttft_128_ms_prefill_graphs"] = 1000 * sorted(run_requests(engine, one, 1)["ttft_s"][0] for _ in range(5))[2]
    res["bs1_prefill_graphs"] = single_stream(engine, random_prompts(3, 128, vocab, 0), 256)
    saved, engine.runner.prefill_graphs = engine.runner.prefill_graphs, None
    res["ttft_128_ms_eager_prefill"] = 1000 * sorted(run_requests(engine, one, 1)["ttft_s"][0] for _ in range(5))[2]
    engine.runner.prefill_graphs = saved
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
