"""Prometheus metrics under the `kestrel:` namespace, named after vLLM's so dashboards carry over.

Engine-wide counts (running, waiting, KV usage, token and preemption totals, prefix cache, speculative drafts and
acceptance) are read from the AsyncEngine's latest EngineStats snapshot at scrape time; per-request latencies are
observed by the HTTP handlers as each sample finishes. Each app has its own CollectorRegistry, so several servers
can live in one process.

`kestrel:first_token_stage_seconds{stage=...}` splits each request's time to first token along its path
(frontend/first_token.py lists the stages); the stages of one request add up to its server-side TTFT, from the
ASGI app being called (StampReceived) to the first chunk with text handed to the transport.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kestrel.frontend.first_token import STAGE_NAMES, FirstTokenTrace

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# seconds; vLLM's buckets, trimmed
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                 0.4, 0.5, 0.75, 1.0, 2.5)
# seconds; the stages run from tens of microseconds (a pipe hop) to a prefill
_STAGE_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                  1.0, 2.5, 10.0)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0)


class _EngineStatsCollector(Collector):
    """Gauges and cumulative counters straight from the engine's own totals (no double bookkeeping)."""

    def __init__(self, read_stats: Callable[[], object | None], model_name: str) -> None:
        self.read_stats = read_stats
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        stats = self.read_stats()
        labels = ["model_name"]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"kestrel:{name}", doc, labels=labels)
            g.add_metric([self.model_name], value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(f"kestrel:{name}", doc, labels=labels)
            c.add_metric([self.model_name], value)
            return c

        def field(name: str) -> float:
            return float(getattr(stats, name, 0) or 0) if stats is not None else 0.0

        yield gauge("num_requests_running", "Sequences in the running batch.", field("num_running"))
        yield gauge("num_requests_waiting", "Sequences waiting to be scheduled.", field("num_waiting"))
        yield gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).", field("kv_cache_usage"))
        yield gauge("num_kv_blocks_used", "KV cache blocks held by requests.", field("num_used_blocks"))
        yield counter("prompt_tokens", "Prompt tokens processed.", field("prompt_tokens_total"))
        yield counter("generation_tokens", "Tokens generated.", field("generation_tokens_total"))
        yield counter("num_preemptions", "Sequences preempted for lack of KV blocks.", field("num_preemptions"))
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      field("prefix_cache_queries"))
        yield counter("prefix_cache_hits", "Prompt tokens served by the prefix cache.", field("prefix_cache_hits"))
        # Speculative decoding: always exposed, 0 when the engine does not speculate, so a scraper's rate() has
        # its first sample before the first draft and the bench tells "no speculation" by zero drafts.
        yield counter("spec_decode_num_drafts", "Verify steps times sequences with a draft.",
                      field("spec_num_drafts"))
        yield counter("spec_decode_num_draft_tokens", "Draft tokens proposed.", field("spec_num_draft_tokens"))
        yield counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.", field("spec_num_accepted_tokens"))
        per_pos = CounterMetricFamily("kestrel:spec_decode_num_accepted_tokens_per_pos",
                                      "Drafts whose token at this draft position was accepted.",
                                      labels=["model_name", "position"])
        for position, accepted in enumerate(getattr(stats, "spec_accepted_per_pos", ()) or ()):
            per_pos.add_metric([self.model_name, str(position)], float(accepted))
        yield per_pos   # one series per draft position (none without speculation)


class ServerMetrics:
    def __init__(self, read_stats: Callable[[], object | None], model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.registry.register(_EngineStatsCollector(read_stats, model_name))
        labels = ["model_name"]
        self.ttft = Histogram("kestrel:time_to_first_token_seconds", "Arrival to first token, per sample.",
                              labels, buckets=_TTFT_BUCKETS, registry=self.registry).labels(model_name)
        self.tpot = Histogram("kestrel:time_per_output_token_seconds", "Mean gap between output tokens, per sample.",
                              labels, buckets=_TPOT_BUCKETS, registry=self.registry).labels(model_name)
        self.e2e = Histogram("kestrel:e2e_request_latency_seconds", "Arrival to last token, per sample.",
                             labels, buckets=_E2E_BUCKETS, registry=self.registry).labels(model_name)
        self.queue_time = Histogram("kestrel:request_queue_time_seconds", "Waiting before first scheduled.",
                                    labels, buckets=_E2E_BUCKETS, registry=self.registry).labels(model_name)
        stages = Histogram("kestrel:first_token_stage_seconds",
                           "Time to first token split along the request's path, per request.",
                           labels + ["stage"], buckets=_STAGE_BUCKETS, registry=self.registry)
        self.first_token_stages = {name: stages.labels(model_name, name) for name in STAGE_NAMES}
        self._success = Counter("kestrel:request_success", "Finished samples by finish reason.",
                                labels + ["finished_reason"], registry=self.registry)
        for reason in ("stop", "length", "abort"):   # every series exists from the start, at 0
            self._success.labels(model_name, reason)

    def observe_sample(self, timing: SampleTiming) -> None:
        """Record one finished sample (each of a request's n choices counts, as in vLLM V1)."""
        if timing.first_token_time is not None:
            self.ttft.observe(timing.first_token_time - timing.arrival_time)
            if timing.num_tokens > 1:
                self.tpot.observe((timing.finish_time - timing.first_token_time) / (timing.num_tokens - 1))
        if timing.queue_time_s is not None:
            self.queue_time.observe(timing.queue_time_s)
        self.e2e.observe(timing.finish_time - timing.arrival_time)
        self._success.labels(self.model_name, timing.finish_reason or "abort").inc()

    def observe_first_token(self, trace: FirstTokenTrace) -> None:
        """One request's stages (those it reached: a non-streamed request has no sse_write)."""
        for name, seconds in trace.stages().items():
            self.first_token_stages[name].observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class SampleTiming:
    """Timestamps of one sample (time.monotonic seconds), filled in by the handler as deltas arrive."""
    __slots__ = ("arrival_time", "first_token_time", "finish_time", "num_tokens", "queue_time_s", "finish_reason")

    def __init__(self, arrival_time: float) -> None:
        self.arrival_time = arrival_time
        self.first_token_time: float | None = None
        self.finish_time = arrival_time
        self.num_tokens = 0
        self.queue_time_s: float | None = None
        self.finish_reason: str | None = None


RECEIVED = "kestrel.received"   # the ASGI scope's key for StampReceived's stamp


class StampReceived:
    """ASGI middleware, the first after Starlette's error handler: stamps time.monotonic() into the scope as soon
    as the app is called (request line and headers parsed, the body perhaps still arriving): the first stamp of
    FirstTokenTrace."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        scope[RECEIVED] = time.monotonic()
        await self.app(scope, receive, send)
