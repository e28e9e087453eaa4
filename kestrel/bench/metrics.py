"""Serving metrics from per-request records: TTFT, TPOT, ITL, E2E, throughput, goodput, percentiles.

Definitions (docs/bench.md has the long form):
  TTFT  request sent -> first token received.
  E2E   request sent -> response complete.
  TPOT  per request, (E2E - TTFT) / (output_tokens - 1); requests with one token have none.
  ITL   per *token*: a streamed chunk carrying k tokens that arrives g seconds after the previous chunk gives k
        gaps of g/k (the extra tokens of the first chunk give gaps of 0: they came with the first token).
        So sum(ITL) = last chunk - first chunk and mean ITL ~= TPOT whatever the server's chunking.
  ITL per chunk  vLLM's ITL: the gap between consecutive token-bearing chunks, one sample per chunk.
  Throughput  completed requests, output tokens and (input + output) tokens per second of benchmark duration.
  Goodput     completed requests per second that meet every SLO given (--slo ttft:MS,tpot:MS,e2e:MS).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kestrel.errors import KestrelError

SLO_KEYS = ("ttft", "tpot", "e2e")
PERCENTILES = (50, 90, 99)


def token_gaps(chunk_times: Sequence[float], chunk_tokens: Sequence[int]) -> list[float]:
    """Per-token inter-token latencies (seconds) from chunk arrival times and token counts per chunk."""
    gaps: list[float] = []
    prev: float | None = None
    for t, k in zip(chunk_times, chunk_tokens):
        if k <= 0:
            continue
        if prev is None:
            gaps.extend([0.0] * (k - 1))
        else:
            gaps.extend([(t - prev) / k] * k)
        prev = t
    return gaps


def reconcile_chunk_tokens(estimates: Sequence[int], total: int) -> list[int]:
    """Make per-chunk token estimates (re-tokenized chunk text, or 1 each) add up to the server's total.

    As many chunks as tokens: one each. Otherwise the total is shared in proportion to the estimates (largest
    remainders first), at least one token per chunk while there are enough tokens.
    """
    n = len(estimates)
    if n == 0 or total <= 0 or sum(estimates) == total:
        return list(estimates)
    if n == total:
        return [1] * n
    floor = 1 if total >= n else 0
    spare = total - floor * n
    weights = [max(e, 1) for e in estimates]
    shares = [spare * w / sum(weights) for w in weights]
    out = [floor + int(x) for x in shares]
    by_remainder = sorted(range(n), key=lambda i: shares[i] - int(shares[i]), reverse=True)
    for i in by_remainder[:total - sum(out)]:
        out[i] += 1
    return out


def distribution(values: Sequence[float], scale: float = 1.0) -> dict[str, float | None]:
    """mean, std, min, max and p50/p90/p99 (linear interpolation, as numpy and vLLM) of values * scale."""
    keys = ["mean", "std", "min", "max"] + [f"p{p}" for p in PERCENTILES]
    if len(values) == 0:
        return dict.fromkeys(keys)
    arr = np.asarray(values, dtype=np.float64) * scale
    out = {"mean": float(arr.mean()), "std": float(arr.std()), "min": float(arr.min()), "max": float(arr.max())}
    for p in PERCENTILES:
        out[f"p{p}"] = float(np.percentile(arr, p))
    return out


def parse_slo(text: str | None) -> dict[str, float]:
    """'ttft:200,tpot:50' -> {'ttft': 200.0, 'tpot': 50.0} (milliseconds)."""
    if not text:
        return {}
    slo = {}
    for part in text.split(","):
        key, _, value = part.partition(":")
        key = key.strip().lower()
        try:
            ms = float(value)
        except ValueError:
            ms = -1.0
        if key not in SLO_KEYS or ms <= 0:
            raise KestrelError(f"--slo {text!r} is invalid: expected comma-separated KEY:MS with KEY in "
                               f"{', '.join(SLO_KEYS)} and MS > 0, e.g. ttft:200,tpot:50")
        slo[key] = ms
    return slo


def tpot(record: dict[str, Any]) -> float | None:
    """Seconds per output token after the first; None without TTFT or with a single token."""
    if record["ttft"] is None or record["output_tokens"] < 2:
        return None
    return (record["e2e"] - record["ttft"]) / (record["output_tokens"] - 1)


def meets_slo(record: dict[str, Any], slo: dict[str, float]) -> bool | None:
    """True/False, or None when a needed metric is unknown (TTFT of a non-streamed request)."""
    values = {"ttft": record["ttft"], "e2e": record["e2e"], "tpot": tpot(record)}
    if "ttft" in slo and values["ttft"] is None:
        return None
    if "tpot" in slo and values["tpot"] is None and record["ttft"] is None:
        return None
    return all((values[k] or 0.0) * 1000.0 <= ms for k, ms in slo.items())


def summarize(records: Sequence[dict[str, Any]], duration_s: float,
              slo: dict[str, float] | None = None) -> dict[str, Any]:
    """Aggregate one run. `records` are RequestRecord.to_dict() rows; times in seconds, reported in ms."""
    ok = [r for r in records if r["success"]]
    duration_s = max(duration_s, 1e-9)
    out_tokens = sum(r["output_tokens"] for r in ok)
    in_tokens = sum(r["prompt_tokens"] for r in ok)
    tpots = [t for t in (tpot(r) for r in ok) if t is not None]
    itls = [g for r in ok for g in r["itl"]]
    chunk_gaps = [b - a for r in ok for a, b in zip(r.get("chunk_times") or [], (r.get("chunk_times") or [])[1:])]
    cached = [r["cached_tokens"] for r in ok if r.get("cached_tokens") is not None]
    rates = [r["output_tokens"] / r["e2e"] for r in ok if r["e2e"] and r["output_tokens"]]
    ms_per_token = [r["e2e"] / r["output_tokens"] for r in ok if r["output_tokens"]]
    summary: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration_s,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        # prompt tokens the server reported as served from its prefix cache (usage.prompt_tokens_details)
        "total_cached_tokens": sum(cached) if cached else None,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": out_tokens / duration_s,
        "total_token_throughput": (in_tokens + out_tokens) / duration_s,
        "ttft_ms": distribution([r["ttft"] for r in ok if r["ttft"] is not None], 1000.0),
        "tpot_ms": distribution(tpots, 1000.0),
        "itl_ms": distribution(itls, 1000.0),
        "itl_per_chunk_ms": distribution(chunk_gaps, 1000.0),
        "e2e_ms": distribution([r["e2e"] for r in ok], 1000.0),
        "per_request_tok_s": distribution(rates),          # single-stream speed of each request
        "ms_per_token": distribution(ms_per_token, 1000.0),  # E2E / output tokens, the tuning-report number
        "token_count_source": sorted({r["token_source"] for r in ok}),
        "errors": sorted({r["error"] for r in records if r["error"]})[:10],
        "slo_ms": dict(slo or {}),
        "goodput": None,
        "slo_attainment": None,
    }
    if slo and ok:
        verdicts = [meets_slo(r, slo) for r in ok]
        if None not in verdicts:
            good = sum(bool(v) for v in verdicts)
            summary["goodput"] = good / duration_s
            summary["slo_attainment"] = good / len(records)
    return summary
