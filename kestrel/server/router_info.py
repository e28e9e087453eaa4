"""What a router in front of several `kestrel serve` replicas reads from each one, in the schema SGLang's
routers read (SGLang Model Gateway / `sglang-router`, and its successor Shepherd Model Gateway, `smg`).

    GET /server_info, /get_server_info   the served model and the limits: context length, KV capacity in tokens,
                                         the running-request cap, parallel sizes (smg turns them into labels)
    GET /model_info, /get_model_info     the checkpoint and tokenizer paths; a generative model
    GET /get_load                        the older routers' form (sglang-router 0.3): [{dp_rank, num_reqs,
                                         num_waiting_reqs, num_tokens}], num_tokens the token load they sum
    GET /v1/loads                        one load snapshot (one data-parallel rank: Kestrel has none) with the
                                         running and waiting requests, KV tokens used / capacity and their
                                         ratio, the prefix-cache hit rate, generation throughput

A router probes `/v1/loads` every --load-monitor-interval seconds and feeds load-aware policies (power_of_two,
least_load, cache_aware's balance check) with it; a 5xx says "try again", a 404 would say "never ask again", so
it answers 503 while the model loads. `num_total_tokens`, the token load the older `sglang-router` sums, is the
tokens held in the KV cache. The bodies are built from the engine's latest `EngineStats` (the same snapshot
/metrics reads), so the router and Prometheus never disagree.
"""
from __future__ import annotations

import datetime
import time
from dataclasses import dataclass

import kestrel
from kestrel.engine.messages import EngineLimits, EngineStats


@dataclass(frozen=True, slots=True)
class WorkerIdentity:
    """What does not change while a server runs."""
    model_name: str
    model_path: str
    tokenizer_path: str
    block_size: int
    max_num_seqs: int
    tensor_parallel_size: int


class ThroughputMeter:
    """Generated tokens per second between two load reports (a router polls every few seconds)."""

    def __init__(self) -> None:
        self._last: tuple[float, int] | None = None   # (monotonic seconds, generation tokens total)
        self._rate = 0.0

    def update(self, generation_tokens_total: int, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        if self._last is not None and now - self._last[0] >= 0.5:   # closer polls keep the previous rate
            seconds, tokens = now - self._last[0], generation_tokens_total - self._last[1]
            self._rate = max(tokens, 0) / seconds
            self._last = (now, generation_tokens_total)
        elif self._last is None:
            self._last = (now, generation_tokens_total)
        return self._rate


def load_snapshot(identity: WorkerIdentity, limits: EngineLimits, stats: EngineStats | None,
                  gen_throughput: float, in_flight: int) -> dict:
    """One `loads[]` entry: SGLang's per-rank scheduler load (integers where the routers parse integers).

    `in_flight` (the server's open requests) caps the engine's counts: the engine's snapshot is taken after its
    last step, which still ran the requests that step finished, and an idle engine takes no further step."""
    running = min(stats.num_running, in_flight) if stats else 0
    waiting = min(stats.num_waiting, in_flight - running) if stats else 0
    used_tokens = min(stats.num_used_blocks * identity.block_size, limits.kv_capacity_tokens) if stats else 0
    queries = stats.prefix_cache_queries if stats else 0
    return {
        "dp_rank": 0,
        "num_running_reqs": running,
        "num_waiting_reqs": waiting,
        "num_total_reqs": running + waiting,
        "num_used_tokens": used_tokens,
        "num_total_tokens": used_tokens,
        "max_total_num_tokens": limits.kv_capacity_tokens,
        "token_usage": round(float(stats.kv_cache_usage), 6) if stats else 0.0,
        "gen_throughput": round(gen_throughput, 3),
        "cache_hit_rate": round(stats.prefix_cache_hits / queries, 6) if queries else 0.0,
        "utilization": round(running / identity.max_num_seqs, 6),
        "max_running_requests": identity.max_num_seqs,
    }


def loads_body(identity: WorkerIdentity, limits: EngineLimits, stats: EngineStats | None,
               gen_throughput: float, in_flight: int, dp_rank: int | None = None) -> dict:
    """GET /v1/loads: SGLang's `{timestamp, version, dp_rank_count, loads[], aggregate}`."""
    snapshot = load_snapshot(identity, limits, stats, gen_throughput, in_flight)
    loads = [snapshot] if dp_rank in (None, 0) else []
    return {
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "version": kestrel.__version__,
        "dp_rank_count": 1,
        "loads": loads,
        "aggregate": {
            "total_running_reqs": snapshot["num_running_reqs"],
            "total_waiting_reqs": snapshot["num_waiting_reqs"],
            "total_reqs": snapshot["num_total_reqs"],
            "total_used_tokens": snapshot["num_used_tokens"],
            "total_tokens": snapshot["num_total_tokens"],
            "avg_token_usage": snapshot["token_usage"],
            "avg_throughput": snapshot["gen_throughput"],
            "avg_utilization": snapshot["utilization"],
        },
    }


def legacy_load_body(identity: WorkerIdentity, limits: EngineLimits, stats: EngineStats | None,
                     in_flight: int) -> list[dict]:
    """GET /get_load: one entry per data-parallel rank, as SGLang answered before /v1/loads."""
    snapshot = load_snapshot(identity, limits, stats, 0.0, in_flight)
    return [{"dp_rank": 0, "num_reqs": snapshot["num_running_reqs"],
             "num_waiting_reqs": snapshot["num_waiting_reqs"], "num_tokens": snapshot["num_used_tokens"]}]


def server_info_body(identity: WorkerIdentity, limits: EngineLimits | None) -> dict:
    """GET /server_info: the fields of SGLang's (server args + limits) that a router reads."""
    body = {
        "model": identity.model_name,
        "model_path": identity.model_path,
        "served_model_name": identity.model_name,
        "tokenizer_path": identity.tokenizer_path,
        "tp_size": identity.tensor_parallel_size,
        "dp_size": 1,
        "pp_size": 1,
        "page_size": identity.block_size,
        "max_running_requests": identity.max_num_seqs,
        "is_embedding": False,
        "version": kestrel.__version__,
        "weight_version": "default",
        "engine": "kestrel",
    }
    if limits is not None:
        body["context_length"] = limits.max_model_len
        body["max_total_num_tokens"] = limits.kv_capacity_tokens
        body["max_total_tokens"] = limits.kv_capacity_tokens
    return body


def model_info_body(identity: WorkerIdentity) -> dict:
    """GET /model_info: SGLang's model identity."""
    return {
        "model_path": identity.model_path,
        "tokenizer_path": identity.tokenizer_path,
        "is_generation": True,
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "weight_version": "default",
    }
