"""`kestrel bench offline [MODEL]`: the same datasets through the engine in-process (no HTTP, no server).

Concurrency c is a true closed loop: c requests are in flight, and each one that finishes is replaced by the next
at once, between two engine steps; with no concurrency every prompt is submitted at the start. TTFT, ITL (per
token) and E2E are timed around the engine's steps, on the same clock as the server benchmark; each run's
prefix_cache (hit rate of its prompt tokens, from Engine.stats()) is the server benchmark's, from the engine.
"""
from __future__ import annotations

import collections
import dataclasses
import datetime
import time
from dataclasses import dataclass, field
from typing import Any

from kestrel.bench.datasets import DatasetConfig
from kestrel.bench.metrics import summarize
from kestrel.bench.serve import RESULT_FORMAT, ServeConfig, plan_runs
from kestrel.bench.server_info import environment
from kestrel.bench.tokenizer import load_tokenizer


@dataclass(frozen=True, slots=True)
class OfflineConfig:
    model: str | None = None
    device: str = "auto"
    preset: str | None = None
    concurrency: tuple[int, ...] = ()
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    tokenizer: str | None = None
    num_prompts: int | None = None
    seed: int = 0
    label: str | None = None

    def as_serve_config(self) -> ServeConfig:
        """The run plan is the server benchmark's (same presets, same datasets)."""
        shared = {f.name: getattr(self, f.name) for f in dataclasses.fields(ServeConfig)
                  if hasattr(self, f.name) and f.name != "model"}
        return ServeConfig(base_url="offline", warmup_requests=0, stream=False, **shared)


def _closed_loop(engine, prompt_ids: list[list[int]], params: list, concurrency: int | None
                 ) -> tuple[list[dict[str, Any]], float]:
    """Keep `concurrency` requests in flight until all are done; per-request records and the run's duration."""
    cap = concurrency or len(prompt_ids)
    waiting = collections.deque(range(len(prompt_ids)))
    live: dict[str, dict[str, Any]] = {}
    rows: list[dict[str, Any] | None] = [None] * len(prompt_ids)
    run_start = time.perf_counter()
    while waiting or live:
        while waiting and len(live) < cap:
            i = waiting.popleft()
            rid = f"offline-{i}"
            engine.add_request(rid, prompt_ids[i], params[i])
            live[rid] = {"i": i, "sent": time.perf_counter(), "first": None, "last": None, "itl": [], "tokens": 0}
        for up in engine.step():
            now = time.perf_counter()
            st = live[up.request_id]
            k = len(up.new_token_ids)
            if k:
                if st["first"] is None:
                    st["first"] = now
                    st["itl"] += [0.0] * (k - 1)
                else:
                    st["itl"] += [(now - st["last"]) / k] * k   # a step's k tokens share its gap (docs/bench.md)
                st["last"] = now
                st["tokens"] += k
            if up.finished:
                i = st["i"]
                rows[i] = {"start": st["sent"] - run_start, "ttft": (st["first"] or now) - st["sent"],
                           "e2e": now - st["sent"], "output_tokens": st["tokens"],
                           "prompt_tokens": len(prompt_ids[i]), "prompt_len": len(prompt_ids[i]),
                           "max_tokens": params[i].max_tokens, "itl": st["itl"], "token_source": "engine",
                           "success": True, "error": None, "finish_reason": up.finish_reason,
                           "num_cached_tokens": up.num_cached_tokens}
                del live[up.request_id]
    return [r for r in rows if r is not None], time.perf_counter() - run_start


def engine_prefix_cache_stats(before, after) -> dict[str, Any]:
    """The prefix-cache hit rate of one run from Engine.stats() before and after it, in the shape `kestrel bench
    serve` gives from /metrics (server_info.prefix_cache_stats), so reports read both alike."""
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    hits = after.prefix_cache_hits - before.prefix_cache_hits

    def cumulative(s) -> float | None:
        return s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else None

    return {"source": "engine", "queries": queries, "hits": hits, "hit_rate": hits / queries if queries > 0 else None,
            "hit_rate_before": cumulative(before), "hit_rate_after": cumulative(after)}


def run_offline_benchmark(cfg: OfflineConfig) -> dict[str, Any]:
    from kestrel import LLM, SamplingParams

    serve_cfg = cfg.as_serve_config()
    llm = LLM(model=cfg.model, device=cfg.device)
    # the engine's own checkpoint has the tokenizer: random prompts of exact lengths without --tokenizer
    tokenizer = load_tokenizer(cfg.tokenizer, (str(llm.config.model_path),))
    runs = [r for r in plan_runs(serve_cfg, tokenizer) if not r.name.endswith("-stream")]
    results = []
    for spec in runs:
        params = [SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True, min_tokens=r.output_len)
                  for r in spec.requests]
        prompt_ids = [llm.tokenizer.encode(r.prompt) if isinstance(r.prompt, str) else list(r.prompt)
                      for r in spec.requests]
        before = llm.engine.stats()
        rows, duration = _closed_loop(llm.engine, prompt_ids, params, spec.concurrency)
        after = llm.engine.stats()
        results.append({"name": spec.name, "concurrency": spec.concurrency, "request_rate": None, "stream": False,
                        "num_requests": len(rows), "summary": summarize(rows, duration),
                        "prefix_cache": engine_prefix_cache_stats(before, after), "spec_decode": None,
                        "requests": rows})
    model = llm.config.model_name
    return {"format": RESULT_FORMAT, "kind": "offline", "label": cfg.label or f"{model} (offline)",
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "config": dataclasses.asdict(cfg) | {"concurrency": list(cfg.concurrency)},
            "server": {"model": model, "device": cfg.device}, "environment": environment(), "runs": results}
