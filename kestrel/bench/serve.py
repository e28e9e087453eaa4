"""`kestrel bench serve`: turn a ServeConfig into runs, run them against the server, build the result dict."""
from __future__ import annotations

import asyncio
import dataclasses
import datetime
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kestrel.bench.client import ApiOptions, probe_features, run_load, warmup
from kestrel.bench.datasets import (DEFAULT_INPUT_LEN, DEFAULT_OUTPUT_LEN, BenchRequest, DatasetConfig,
                                    build_requests, fixed_requests)
from kestrel.bench.metrics import parse_slo, summarize
from kestrel.bench.server_info import (environment, first_model, model_root, prefix_cache_stats, scrape_metrics,
                                       scrape_metrics_sum, server_info, spec_decode_stats)
from kestrel.bench.tokenizer import BenchTokenizer, load_tokenizer
from kestrel.config import DEFAULT_MODEL_DIR
from kestrel.errors import KestrelError

PRESETS = ("single-and-peak", "sweep")
SWEEP_CONCURRENCY = (1, 8, 32, 128)
PEAK_CONCURRENCY = 128
SINGLE_AND_PEAK_INPUT_LEN = 128
SINGLE_AND_PEAK_OUTPUT_LEN = 256
SINGLE_REQUESTS = 3
RESULT_FORMAT = 2   # 2: config.dataset is a DatasetConfig; runs carry prefix_cache


@dataclass(frozen=True, slots=True)
class ServeConfig:
    base_url: str
    model: str | None = None
    endpoint: str = "completions"
    preset: str | None = None
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    tokenizer: str | None = None
    num_prompts: int | None = None         # None: 200, or per preset
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
    metrics_urls: tuple[str, ...] = ()     # servers whose /metrics are summed (replicas behind a router)

    def __post_init__(self) -> None:
        if self.preset not in (None, *PRESETS):
            raise KestrelError(f"--preset {self.preset!r} is invalid: expected one of {', '.join(PRESETS)}")
        if self.endpoint not in ("completions", "chat"):
            raise KestrelError(f"--endpoint {self.endpoint!r} is invalid: expected completions or chat")
        if any(c < 1 for c in self.concurrency):
            raise KestrelError(f"--max-concurrency {self.concurrency} is invalid: expected integers >= 1")
        if self.request_rate <= 0 or self.burstiness <= 0:
            raise KestrelError(f"--request-rate {self.request_rate} / --burstiness {self.burstiness} are invalid: "
                               "expected numbers > 0")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise KestrelError(f"--num-prompts {self.num_prompts} is invalid: expected an integer >= 1")
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


def plan_runs(cfg: ServeConfig, tokenizer: BenchTokenizer | None) -> list[RunSpec]:
    """The runs of a preset (or of --max-concurrency values). Each run gets prompts of its own (seed + run index):
    a run repeating the previous run's prompts would find them in the prefix cache and time cache hits."""
    data = cfg.dataset
    token_prompts = cfg.endpoint == "completions"

    def requests(index: int, num: int | None, input_len: int, output_len: int) -> list[BenchRequest]:
        return build_requests(data, num, input_len, output_len, tokenizer, cfg.seed + index, token_prompts)

    if cfg.preset == "single-and-peak":
        # The tuning-report method: a few requests one at a time, then PEAK concurrent; non-streamed (the numbers
        # the report always quoted), then the same shapes streamed for TTFT. Distinct prompts of stated lengths.
        input_len = data.input_len or SINGLE_AND_PEAK_INPUT_LEN
        output_len = data.output_len or SINGLE_AND_PEAK_OUTPUT_LEN
        peak = max(cfg.concurrency) if cfg.concurrency else PEAK_CONCURRENCY
        num_peak = cfg.num_prompts or peak
        shapes = [("single", SINGLE_REQUESTS, 1, False), ("peak", num_peak, peak, False),
                  ("single-stream", SINGLE_REQUESTS, 1, True), ("peak-stream", num_peak, peak, True)]
        return [RunSpec(name, requests(i, num, input_len, output_len), conc, stream)
                for i, (name, num, conc, stream) in enumerate(shapes)]
    input_len, output_len = data.input_len or DEFAULT_INPUT_LEN, data.output_len or DEFAULT_OUTPUT_LEN
    num = cfg.num_prompts or data.default_num()
    if cfg.preset == "sweep":
        return [RunSpec(f"c={c}", requests(i, num or max(16, 4 * c), input_len, output_len), c, True)
                for i, c in enumerate(cfg.concurrency or SWEEP_CONCURRENCY)]
    rate = "" if math.isinf(cfg.request_rate) else f"rate={cfg.request_rate:g}"
    if not cfg.concurrency:
        return [RunSpec(rate or "all-at-once", requests(0, num, input_len, output_len), None, cfg.stream,
                        cfg.request_rate)]
    return [RunSpec(",".join(filter(None, [f"c={c}", rate])), requests(i, num, input_len, output_len), c,
                    cfg.stream, cfg.request_rate)
            for i, c in enumerate(cfg.concurrency)]


def _run_one(cfg: ServeConfig, api: ApiOptions, spec: RunSpec, tokenizer: BenchTokenizer | None) -> dict[str, Any]:
    api = dataclasses.replace(api, stream=spec.stream)
    # Warm up on the fixed prompts, not on the run's own: a warmed-up prompt would be a prefix-cache hit.
    warm = fixed_requests(spec.requests[0].output_len, cfg.warmup_requests)
    asyncio.run(warmup(api, warm, cfg.warmup_requests, spec.concurrency))
    scrape = (lambda: scrape_metrics_sum(cfg.metrics_urls)) if cfg.metrics_urls else \
        (lambda: scrape_metrics(cfg.base_url))
    before = scrape()
    records, duration = asyncio.run(run_load(api, spec.requests, spec.concurrency, spec.request_rate,
                                             cfg.burstiness, cfg.duration_s, tokenizer, cfg.seed, cfg.progress,
                                             spec.name))
    after = scrape()
    rows = [r.to_dict() for r in records]
    return {"name": spec.name, "concurrency": spec.concurrency,
            "request_rate": None if math.isinf(spec.request_rate) else spec.request_rate,
            "stream": spec.stream, "num_requests": len(rows),
            "summary": summarize(rows, duration, parse_slo(cfg.slo)),
            "prefix_cache": prefix_cache_stats(before, after),
            "spec_decode": spec_decode_stats(before, after), "requests": rows}


def run_serve_benchmark(cfg: ServeConfig, on_run: Callable[[dict[str, Any]], None] | None = None,
                        on_note: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run every planned run; `on_run(run_dict)` is called after each (the CLI prints a line), `on_note(text)`
    with what the user should know before the numbers (the CLI prints it to stderr)."""
    info = server_info(cfg.base_url)   # first: a server that is not there is the error to report
    model = cfg.model or first_model(info)
    if not model:
        raise KestrelError(f"--model is needed: {cfg.base_url}/v1/models answered but named no model")
    # Kestrel serves its embedded model under the directory's name, not a path: look where Kestrel keeps it.
    embedded = str(DEFAULT_MODEL_DIR) if model == DEFAULT_MODEL_DIR.name else None
    tokenizer = load_tokenizer(cfg.tokenizer, (cfg.model, model, model_root(info), embedded))
    if tokenizer is None and cfg.dataset.name in ("random", "prefix-repetition", "shared-prefix") and on_note:
        on_note("no tokenizer (pass --tokenizer DIR, or serve a local checkpoint path): random prompts are common "
                "words, about one token each, so their lengths are approximate; the report counts the server's "
                "usage.prompt_tokens")
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
                                        "tokenizer": tokenizer.path if tokenizer else None,
                                        "request_rate": None if math.isinf(cfg.request_rate) else cfg.request_rate}
    features = {"ignore_eos_min_tokens": api.ignore_eos, "include_usage": api.include_usage,
                "continuous_usage_stats": api.continuous_usage}
    return {"format": RESULT_FORMAT, "kind": "serve", "label": cfg.label or model,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "config": config, "server": info | {"model": model, "accepted_options": features},
            "environment": environment(), "runs": results}
