"""`kestrel bench offline [MODEL]`: the same datasets through `LLM.generate` in-process (no HTTP, no server).

Concurrency c means prompts are handed to `generate` c at a time (each call runs its batch to completion); with
no concurrency every prompt goes in one call and the engine's scheduler decides the batching. TTFT and E2E come
from the engine's own request timestamps; ITL is not observable here.
"""
from __future__ import annotations

import dataclasses
import datetime
import time
from dataclasses import dataclass
from typing import Any

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
    dataset: str = "random"
    dataset_path: str | None = None
    tokenizer: str | None = None
    input_len: int = 1024
    output_len: int | None = None
    range_ratio: float = 0.0
    num_prompts: int | None = None
    num_groups: int = 8
    prompts_per_group: int = 16
    prefix_len: int = 512
    suffix_len: int = 64
    seed: int = 0
    label: str | None = None

    def as_serve_config(self) -> ServeConfig:
        """The run plan is the server benchmark's (same presets, same datasets)."""
        shared = {f.name: getattr(self, f.name) for f in dataclasses.fields(ServeConfig)
                  if hasattr(self, f.name) and f.name != "model"}
        return ServeConfig(base_url="offline", warmup_requests=0, stream=False, **shared)


def _records(outputs, batch_start: float, run_start: float) -> list[dict[str, Any]]:
    rows = []
    for out in outputs:
        tokens = sum(len(o.token_ids) for o in out.outputs)
        m = out.metrics
        rows.append({"start": batch_start - run_start, "ttft": m.ttft_s, "e2e": m.e2e_s, "output_tokens": tokens,
                     "prompt_tokens": len(out.prompt_token_ids), "prompt_len": len(out.prompt_token_ids),
                     "max_tokens": None, "itl": [], "token_source": "engine", "success": True, "error": None,
                     "finish_reason": out.outputs[0].finish_reason if out.outputs else None,
                     "num_cached_tokens": out.num_cached_tokens})
    return rows


def run_offline_benchmark(cfg: OfflineConfig) -> dict[str, Any]:
    from kestrel import LLM, SamplingParams

    serve_cfg = cfg.as_serve_config()
    runs = [r for r in plan_runs(serve_cfg, load_tokenizer(cfg.tokenizer)) if not r.name.endswith("-stream")]
    llm = LLM(model=cfg.model, device=cfg.device)
    results = []
    for spec in runs:
        params = [SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True, min_tokens=r.output_len)
                  for r in spec.requests]
        prompts = [r.prompt for r in spec.requests]
        step = spec.concurrency or len(prompts)
        rows: list[dict[str, Any]] = []
        run_start = time.perf_counter()
        for i in range(0, len(prompts), step):
            batch_start = time.perf_counter()
            rows += _records(llm.generate(prompts[i:i + step], params[i:i + step]), batch_start, run_start)
        duration = time.perf_counter() - run_start
        results.append({"name": spec.name, "concurrency": spec.concurrency, "request_rate": None, "stream": False,
                        "num_requests": len(rows), "summary": summarize(rows, duration), "spec_decode": None,
                        "requests": rows})
    model = llm.config.model_name
    return {"format": RESULT_FORMAT, "kind": "offline", "label": cfg.label or f"{model} (offline)",
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "config": dataclasses.asdict(cfg) | {"concurrency": list(cfg.concurrency)},
            "server": {"model": model, "device": cfg.device}, "environment": environment(), "runs": results}
