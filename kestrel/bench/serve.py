"""`kestrel bench serve`: turn a ServeConfig into runs, run them against the server, build the result dict."""
from __future__ import annotations

import asyncio
import dataclasses
import datetime
import math
from dataclasses import dataclass
from typing import Any

from kestrel.bench.client import ApiOptions, probe_features, run_load, warmup
from kestrel.bench.datasets import (BenchRequest, fixed_requests, jsonl_requests, random_requests,
                                    shared_prefix_requests)
from kestrel.bench.metrics import parse_slo, summarize
from kestrel.bench.server_info import environment, first_model, scrape_metrics, server_info, spec_decode_stats
from kestrel.bench.tokenizer import BenchTokenizer, load_tokenizer
from kestrel.errors import KestrelError

PRESETS = ("single-and-peak", "sweep")
DATASETS = ("random", "jsonl", "shared-prefix", "fixed")
SWEEP_CONCURRENCY = (1, 8, 32, 128)
PEAK_CONCURRENCY = 128
SINGLE_AND_PEAK_OUTPUT_LEN = 256
RESULT_FORMAT = 1


@dataclass(frozen=True, slots=True)
class ServeConfig:
    base_url: str
    model: str | None = None
    endpoint: str = "completions"
    preset: str | None = None
    dataset: str = "random"
    dataset_path: str | None = None
    tokenizer: str | None = None
    input_len: int = 1024
    output_len: int | None = None          # None: 128, or 256 for single-and-peak
    range_ratio: float = 0.0
    num_prompts: int | None = None         # None: 200, or per preset
    num_groups: int = 8
    prompts_per_group: int = 16
    prefix_len: int = 512
    suffix_len: int = 64
    concurrency: tuple[int, ...] = ()      # several values: one run each (a sweep)
    request_rate: float = math.inf
    burstiness: float = 1.0
    duration_s: float | None = None
    warmup_requests: int = 1
    stream: bool = True
    ignore_eos: bool = True
    slo: str | None = None
    seed: int = 0
    label: str | None = None
    timeout_s: float = 600.0
    progress: bool = True

    def __post_init__(self) -> None:
        if self.preset not in (None, *PRESETS):
            raise KestrelError(f"--preset {self.preset!r} is invalid: expected one of {', '.join(PRESETS)}")
        if self.dataset not in DATASETS:
            raise KestrelError(f"--dataset {self.dataset!r} is invalid: expected one of {', '.join(DATASETS)}")
        if self.dataset == "jsonl" and not self.dataset_path:
            raise KestrelError("--dataset jsonl needs --dataset-path FILE.jsonl")
        if self.endpoint not in ("completions", "chat"):
            raise KestrelError(f"--endpoint {self.endpoint!r} is invalid: expected completions or chat")
        if any(c < 1 for c in self.concurrency):
            raise KestrelError(f"--concurrency {self.concurrency} is invalid: expected integers >= 1")
        if self.request_rate <= 0 or self.burstiness <= 0:
            raise KestrelError(f"--request-rate {self.request_rate} / --burstiness {self.burstiness} are invalid: "
                               "expected numbers > 0")
        for name in ("input_len", "output_len", "num_prompts"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise KestrelError(f"--{name.replace('_', '-')} {value} is invalid: expected an integer >= 1")
        if self.duration_s is not None and (self.duration_s <= 0 or (not self.concurrency and not self.preset
                                                                     and math.isinf(self.request_rate))):
            raise KestrelError(f"--duration {self.duration_s} is invalid: expected seconds > 0, with --concurrency "
                               "or --request-rate (otherwise requests would be issued without bound)")
        parse_slo(self.slo)


@dataclass(frozen=True, slots=True)
class RunSpec:
    name: str
    requests: list[BenchRequest]
    concurrency: int | None
    stream: bool
    request_rate: float = math.inf


def _dataset(cfg: ServeConfig, num: int, output_len: int, tokenizer: BenchTokenizer | None) -> list[BenchRequest]:
    if cfg.dataset == "fixed":
        return fixed_requests(output_len, num)
    if cfg.dataset == "jsonl":
        return jsonl_requests(cfg.dataset_path, output_len, tokenizer, num if cfg.num_prompts else None)
    if cfg.dataset == "shared-prefix":
        return shared_prefix_requests(cfg.num_groups, cfg.prompts_per_group, cfg.prefix_len, cfg.suffix_len,
                                      output_len, tokenizer, cfg.seed)
    return random_requests(num, cfg.input_len, output_len, cfg.range_ratio, tokenizer, cfg.seed)


def plan_runs(cfg: ServeConfig, tokenizer: BenchTokenizer | None) -> list[RunSpec]:
    if cfg.preset == "single-and-peak":
        # The tuning-report method: 3 fixed prompts one at a time, then PEAK concurrent; non-streamed (the
        # numbers the report always quoted), then the same streamed for TTFT.
        output_len = cfg.output_len or SINGLE_AND_PEAK_OUTPUT_LEN
        peak = max(cfg.concurrency) if cfg.concurrency else PEAK_CONCURRENCY
        single, burst = fixed_requests(output_len), fixed_requests(output_len, cfg.num_prompts or peak)
        return [RunSpec("single", single, 1, False), RunSpec("peak", burst, peak, False),
                RunSpec("single-stream", single, 1, True), RunSpec("peak-stream", burst, peak, True)]
    output_len = cfg.output_len or 128
    if cfg.preset == "sweep":
        runs = []
        for c in cfg.concurrency or SWEEP_CONCURRENCY:
            num = cfg.num_prompts or max(16, 4 * c)
            runs.append(RunSpec(f"c={c}", _dataset(cfg, num, output_len, tokenizer), c, True))
        return runs
    requests = _dataset(cfg, cfg.num_prompts or 200, output_len, tokenizer)
    rate = "" if math.isinf(cfg.request_rate) else f"rate={cfg.request_rate:g}"
    if not cfg.concurrency:
        return [RunSpec(rate or "all-at-once", requests, None, cfg.stream, cfg.request_rate)]
    return [RunSpec(",".join(filter(None, [f"c={c}", rate])), requests, c, cfg.stream, cfg.request_rate)
            for c in cfg.concurrency]


def _run_one(cfg: ServeConfig, api: ApiOptions, spec: RunSpec, tokenizer: BenchTokenizer | None) -> dict[str, Any]:
    api = dataclasses.replace(api, stream=spec.stream)
    asyncio.run(warmup(api, spec.requests, cfg.warmup_requests, spec.concurrency))
    before = scrape_metrics(cfg.base_url)
    records, duration = asyncio.run(run_load(api, spec.requests, spec.concurrency, spec.request_rate,
                                             cfg.burstiness, cfg.duration_s, tokenizer, cfg.seed, cfg.progress))
    after = scrape_metrics(cfg.base_url)
    rows = [r.to_dict() for r in records]
    return {"name": spec.name, "concurrency": spec.concurrency,
            "request_rate": None if math.isinf(spec.request_rate) else spec.request_rate,
            "stream": spec.stream, "num_requests": len(rows),
            "summary": summarize(rows, duration, parse_slo(cfg.slo)),
            "spec_decode": spec_decode_stats(before, after), "requests": rows}


def run_serve_benchmark(cfg: ServeConfig, on_run=None) -> dict[str, Any]:
    """Run every planned run; `on_run(run_dict)` is called after each (the CLI prints a line)."""
    tokenizer = load_tokenizer(cfg.tokenizer)
    info = server_info(cfg.base_url)
    model = cfg.model or first_model(info)
    if not model:
        raise KestrelError(f"--model is needed: {cfg.base_url}/v1/models did not name a model")
    runs = plan_runs(cfg, tokenizer)
    api = ApiOptions(cfg.base_url, model, cfg.endpoint, stream=any(r.stream for r in runs),
                     ignore_eos=cfg.ignore_eos, timeout_s=cfg.timeout_s)
    api = asyncio.run(probe_features(api))
    results = []
    for spec in runs:
        results.append(_run_one(cfg, api, spec, tokenizer))
        if on_run:
            on_run(results[-1])
    config = dataclasses.asdict(cfg) | {"model": model, "concurrency": list(cfg.concurrency),
                                        "request_rate": None if math.isinf(cfg.request_rate) else cfg.request_rate}
    features = {"ignore_eos_min_tokens": api.ignore_eos, "include_usage": api.include_usage,
                "continuous_usage_stats": api.continuous_usage}
    return {"format": RESULT_FORMAT, "kind": "serve", "label": cfg.label or model,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "config": config, "server": info | {"model": model, "accepted_options": features},
            "environment": environment(), "runs": results}
