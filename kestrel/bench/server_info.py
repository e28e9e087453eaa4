"""What a result file records besides timings: server identity, its /metrics (prefix cache, speculative
decoding), the host.

Prefix-cache counters are read before and after a run: hit rate = hit tokens / queried prompt tokens over the run.

Speculative-decoding counters are read before and after a run; the deltas give the acceptance rate (accepted /
draft tokens), the mean accepted length (1 + accepted / drafts: tokens per verify step per sequence, counting the
bonus token, as vLLM reports it) and the acceptance rate at each draft position (accepted there / drafts).
"""
from __future__ import annotations

import importlib.metadata
import platform
import re
import shutil
import socket
import subprocess
import sys
from typing import Any

import httpx

from kestrel.errors import KestrelError

# (drafts, draft tokens, accepted tokens, accepted per position) counter names per server family
SPEC_COUNTERS = {
    family: (f"{family}:spec_decode_num_drafts_total", f"{family}:spec_decode_num_draft_tokens_total",
             f"{family}:spec_decode_num_accepted_tokens_total",
             f"{family}:spec_decode_num_accepted_tokens_per_pos_total")
    for family in ("kestrel", "vllm")
}
# (queried prompt tokens, prompt tokens found in the cache) per server family: vLLM V1's names, which Kestrel uses
PREFIX_CACHE_COUNTERS = {family: (f"{family}:prefix_cache_queries_total", f"{family}:prefix_cache_hits_total")
                         for family in ("kestrel", "vllm")}
SGLANG_CACHE_HIT_RATE = "sglang:cache_hit_rate"   # a gauge over SGLang's recent window
# SGLang exports gauges (averages over its recent window), not counters: read them after the run.
SGLANG_ACCEPT_LENGTH = "sglang:spec_accept_length"
SGLANG_ACCEPT_RATE = "sglang:spec_accept_rate"

PACKAGES = ("kestrel", "torch", "transformers", "vllm", "sglang", "aiohttp", "flashinfer-python", "triton")


def _get_json(client: httpx.Client, url: str) -> Any:
    try:
        resp = client.get(url)
        if resp.status_code != 200:
            return None
        try:
            return resp.json()
        except ValueError:
            return resp.text.strip()[:200]
    except httpx.HTTPError:
        return None


def server_info(base_url: str, timeout_s: float = 10.0) -> dict[str, Any]:
    """/v1/models, /version and SGLang's /get_model_info as the server reports them (None where absent).

    Raises KestrelError, one line, when nothing answers at base_url: the first thing a user must know.
    """
    base = base_url.rstrip("/")
    with httpx.Client(timeout=timeout_s) as client:
        try:
            client.get(base + "/v1/models")
        except httpx.ConnectError as exc:
            raise KestrelError(f"connection refused to {base} ({exc}): no server is listening there; start one "
                               "(kestrel serve MODEL, or kestrel launch --then ...) or pass --base-url") from None
        except httpx.TimeoutException:
            raise KestrelError(f"no answer from {base} within {timeout_s:g} s: is the server up?") from None
        except httpx.HTTPError as exc:
            raise KestrelError(f"cannot reach {base}: {type(exc).__name__}: {exc}") from None
        return {"base_url": base, "models": _get_json(client, base + "/v1/models"),
                "version": _get_json(client, base + "/version"),
                "model_info": _get_json(client, base + "/get_model_info")}


def first_model(info: dict[str, Any]) -> str | None:
    card = _first_card(info)
    return card.get("id") if card else None


def model_root(info: dict[str, Any]) -> str | None:
    """Where the served model's tokenizer may be found: its `root` in /v1/models (vLLM: the checkpoint it loaded),
    else /get_model_info's tokenizer_path or model_path (SGLang's schema; a router such as smg answers /v1/models
    itself, without `root`, but forwards /get_model_info to a worker)."""
    card = _first_card(info)
    if card and card.get("root"):
        return card["root"]
    model_info = info.get("model_info")
    if isinstance(model_info, dict):
        return model_info.get("tokenizer_path") or model_info.get("model_path")
    return None


def _first_card(info: dict[str, Any]) -> dict[str, Any] | None:
    models = info.get("models")
    if isinstance(models, dict) and models.get("data") and isinstance(models["data"][0], dict):
        return models["data"][0]
    return None


def parse_prometheus(text: str) -> dict[str, float]:
    """Sample name -> value, summed over label sets (enough for the counters and gauges read here); a sample with
    a `position` label also counts under its own key, `name{position="i"}` (see at_position)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "{" in line:
            name, rest = line[:line.index("{")], line[line.rindex("}") + 1:]
        else:
            name, _, rest = line.partition(" ")
        try:
            value = float(rest.strip().split()[0])
        except (ValueError, IndexError):
            continue
        values[name] = values.get(name, 0.0) + value
        position = re.search(r'[{,]\s*position="(\d+)"', line)
        if position:
            key = at_position(name, int(position.group(1)))
            values[key] = values.get(key, 0.0) + value
    return values


def at_position(name: str, position: int) -> str:
    return f'{name}{{position="{position}"}}'


def scrape_metrics_sum(urls: tuple[str, ...], timeout_s: float = 10.0) -> dict[str, float] | None:
    """The counters of several servers added up (the replicas behind a router, which has no /metrics of theirs);
    None when none answers."""
    scrapes = [m for m in (scrape_metrics(url, timeout_s) for url in urls) if m is not None]
    if not scrapes:
        return None
    total: dict[str, float] = {}
    for scrape in scrapes:
        for name, value in scrape.items():
            total[name] = total.get(name, 0.0) + value
    return total


def scrape_metrics(base_url: str, timeout_s: float = 10.0) -> dict[str, float] | None:
    try:
        resp = httpx.get(base_url.rstrip("/") + "/metrics", timeout=timeout_s)
    except httpx.HTTPError:
        return None
    return parse_prometheus(resp.text) if resp.status_code == 200 else None


def spec_decode_stats(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, Any] | None:
    """Acceptance over one run from /metrics before and after; None when the server exports none."""
    if after is None:
        return None
    before = before or {}
    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    for source, (drafts_n, draft_tokens_n, accepted_n, per_pos_n) in SPEC_COUNTERS.items():
        if drafts_n in after or accepted_n in after:
            drafts, proposed, accepted = delta(drafts_n), delta(draft_tokens_n), delta(accepted_n)
            per_pos = []
            while at_position(per_pos_n, len(per_pos)) in after:
                per_pos.append(delta(at_position(per_pos_n, len(per_pos))))
            return {"source": source, "num_drafts": drafts, "num_draft_tokens": proposed,
                    "num_accepted_tokens": accepted,
                    "acceptance_rate": accepted / proposed if proposed > 0 else None,
                    "mean_accepted_length": 1.0 + accepted / drafts if drafts > 0 else None,
                    "num_accepted_tokens_per_pos": per_pos or None,
                    "acceptance_rate_per_pos": [a / drafts for a in per_pos] if per_pos and drafts > 0 else None}
    if SGLANG_ACCEPT_LENGTH in after:
        return {"source": "sglang", "num_drafts": None, "num_draft_tokens": None, "num_accepted_tokens": None,
                "acceptance_rate": after.get(SGLANG_ACCEPT_RATE),
                "mean_accepted_length": after[SGLANG_ACCEPT_LENGTH],
                "num_accepted_tokens_per_pos": None, "acceptance_rate_per_pos": None}
    return None


def prefix_cache_stats(before: dict[str, float] | None,
                       after: dict[str, float] | None) -> dict[str, Any] | None:
    """Prefix-cache hit rate over one run from /metrics before and after; None when the server exports none.

    `hit_rate` is the run's (hit tokens / queried tokens between the two scrapes); `hit_rate_before` and
    `hit_rate_after` are the server's cumulative rates at each scrape (everything it served since it started).
    """
    if after is None:
        return None
    before = before or {}
    for source, (queries_n, hits_n) in PREFIX_CACHE_COUNTERS.items():
        if queries_n in after:
            queries = after[queries_n] - before.get(queries_n, 0.0)
            hits = after.get(hits_n, 0.0) - before.get(hits_n, 0.0)

            def cumulative(values: dict[str, float]) -> float | None:
                return values.get(hits_n, 0.0) / values[queries_n] if values.get(queries_n) else None

            return {"source": source, "queries": queries, "hits": hits,
                    "hit_rate": hits / queries if queries > 0 else None,
                    "hit_rate_before": cumulative(before), "hit_rate_after": cumulative(after)}
    if SGLANG_CACHE_HIT_RATE in after:
        return {"source": "sglang", "queries": None, "hits": None, "hit_rate": after[SGLANG_CACHE_HIT_RATE],
                "hit_rate_before": before.get(SGLANG_CACHE_HIT_RATE), "hit_rate_after": after[SGLANG_CACHE_HIT_RATE]}
    return None


def _gpus() -> list[dict[str, str]] | None:
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    rows = [[c.strip() for c in line.split(",")] for line in out.splitlines() if line.strip()]
    return [dict(zip(("name", "memory", "driver"), row)) for row in rows]


def environment() -> dict[str, Any]:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return {"host": socket.gethostname(), "platform": platform.platform(), "python": sys.version.split()[0],
            "packages": versions, "gpus": _gpus()}
