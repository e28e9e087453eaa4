"""Cache-aware routing against round-robin on a prefix-heavy load: shared system prompts over many users.

    python -m benchmarks.router_bench [--replicas 2] [--model PATH] [--device cuda --gpus-per-replica 1]
                                      [--policies round_robin,cache_aware] [--out FILE] [-- extra serve flags]

For each policy: fresh replicas of `kestrel serve` (cold prefix caches) behind smg (`kestrel launch --replicas`'s
ReplicaSet), then `kestrel bench serve`'s shared-prefix dataset — NUM_GROUPS system prompts of PREFIX_LEN tokens,
each followed by PROMPTS_PER_GROUP users' own questions, in an order that interleaves the groups — streamed to
/v1/chat/completions through the router at a fixed concurrency. The prefix-cache hit rate is the replicas'
kestrel:prefix_cache_* counters added up (the router has none); TTFT is the client's. Also recorded: how the
requests split over the replicas (prompt tokens each replica processed). Before the measured run each replica
gets two warm-up requests of the same lengths and other content, straight from the client.

Round-robin sends each group's users to every replica, so every replica computes every system prompt once; the
cache-aware policy keeps a group on the replica whose cache holds its prefix, so each is computed once overall.
Without --model it serves the default model (models/kestrel-tiny) on the CPU. JSON default:
router-MODEL-DEVICE-DATE.json in the current directory.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
from pathlib import Path

from kestrel.bench.datasets import DatasetConfig
from kestrel.bench.replicas import ReplicaConfig, ReplicaSet, free_port_block
from kestrel.bench.serve import ServeConfig, run_serve_benchmark
from kestrel.bench.server_info import environment, scrape_metrics

RESULTS = Path(".")


def warm_replica(url: str, dataset: DatasetConfig, tokenizer: str | None, seed: int) -> None:
    """Two requests of the workload's lengths on one system prompt of other content, straight to the replica (the
    router's prefix tree never sees them): the prefill shapes and the cached-prefix path are compiled before the
    measured run, so the first policy measured does not pay first-use compiles the second finds on disk."""
    warm = dataclasses.replace(dataset, num_groups=1, prompts_per_group=2)
    run_serve_benchmark(ServeConfig(base_url=url, endpoint="chat", dataset=warm, tokenizer=tokenizer,
                                    concurrency=(1,), warmup_requests=0, seed=seed, label="warm-up", progress=False))


def run_policy(policy: str, args: argparse.Namespace, serve_flags: list[str]) -> dict:
    base = free_port_block(args.replicas + 1)
    serve = [sys.executable, "-m", "kestrel.cli", "serve", *([args.model] if args.model else []),
             "--device", args.device, "--disable-log-requests", "--disable-log-stats", *serve_flags]
    cfg = ReplicaConfig(serve_command=tuple(serve), replicas=args.replicas, replica_port=base + 1, router="smg",
                        router_port=base, policy=policy, gpus_per_replica=args.gpus_per_replica,
                        router_args=("--log-level", "warn"), log_dir=args.log_dir, ready_timeout_s=900,
                        fill_model=False)   # the bench names the model: smg alone, as in the published figures
    dataset = DatasetConfig(name="shared-prefix", num_groups=args.num_groups,
                            prompts_per_group=args.prompts_per_group, prefix_len=args.prefix_len,
                            suffix_len=args.suffix_len, output_len=args.output_len)
    # The prompts are made of the model's own tokens: through the router /v1/models does not carry the checkpoint's
    # path, so the bench is told where the tokenizer is (without one, prompts of common words would all encode to
    # the same unknown-word ids on a word-level tokenizer, and every "system prompt" would be one prefix).
    with ReplicaSet(cfg) as replicas:
        for url in cfg.replica_urls:
            warm_replica(url, dataset, args.model, args.seed + 1)
        before = [scrape_metrics(url) or {} for url in cfg.replica_urls]
        result = run_serve_benchmark(ServeConfig(
            base_url=replicas.url, endpoint="chat", dataset=dataset, tokenizer=args.model,
            concurrency=(args.concurrency,),
            warmup_requests=0, seed=args.seed, label=policy, progress=False, metrics_urls=tuple(cfg.replica_urls)))
        after = [scrape_metrics(url) or {} for url in cfg.replica_urls]
    run = result["runs"][0]
    summary = run["summary"]
    name = "kestrel:prompt_tokens_total"
    split = [a.get(name, 0.0) - b.get(name, 0.0) for a, b in zip(after, before)]
    return {
        "policy": policy,
        "completed": summary["completed"], "failed": summary["failed"],
        "prefix_cache_hit_rate": (run["prefix_cache"] or {}).get("hit_rate"),
        "prefix_cache_hit_tokens": (run["prefix_cache"] or {}).get("hits"),
        "prefix_cache_queried_tokens": (run["prefix_cache"] or {}).get("queries"),
        "ttft_ms": {k: summary["ttft_ms"][k] for k in ("mean", "p50", "p90", "p99") if k in summary["ttft_ms"]},
        "e2e_ms_mean": summary["e2e_ms"]["mean"],
        "request_throughput": summary["request_throughput"],
        "output_throughput": summary["output_throughput"],
        "prompt_tokens_per_replica": split,
        "duration_s": summary["duration_s"],
    }


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the default model")
    p.add_argument("--device", default="cpu")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--gpus-per-replica", type=int, default=0)
    p.add_argument("--policies", default="round_robin,cache_aware")
    p.add_argument("--num-groups", type=int, default=8, help="system prompts")
    p.add_argument("--prompts-per-group", type=int, default=8, help="users per system prompt")
    p.add_argument("--prefix-len", type=int, default=768, help="system prompt tokens")
    p.add_argument("--suffix-len", type=int, default=24, help="each user's question tokens")
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", default="logs")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    runs = [run_policy(policy, args, extra) for policy in args.policies.split(",")]
    model = Path(args.model).name if args.model else "kestrel-tiny"
    record = {
        "benchmark": "router: cache-aware vs round-robin on shared system prompts",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": model, "device": args.device, "replicas": args.replicas, "router": "smg",
        "workload": {"dataset": "shared-prefix", "num_groups": args.num_groups,
                     "prompts_per_group": args.prompts_per_group, "prefix_len": args.prefix_len,
                     "suffix_len": args.suffix_len, "output_len": args.output_len, "endpoint": "chat",
                     "stream": True, "concurrency": args.concurrency, "seed": args.seed, "serve_flags": extra},
        "runs": runs,
        "environment": environment(),
    }
    out = Path(args.out) if args.out else RESULTS / f"router-{model}-{args.device}-{datetime.date.today()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    for run in runs:
        hit = run["prefix_cache_hit_rate"]
        print(f"{run['policy']:>12}: prefix-cache hit {100 * hit:.1f}% | TTFT mean {run['ttft_ms']['mean']:.0f} ms, "
              f"p50 {run['ttft_ms']['p50']:.0f} ms | {run['request_throughput']:.2f} req/s | prompt tokens "
              f"per replica {[int(t) for t in run['prompt_tokens_per_replica']]} | {run['failed']} failed"
              if hit is not None else f"{run['policy']}: no prefix-cache figures")
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
