"""Metric definitions (docs/bench.md): pure arithmetic, then the client's timings against a server of known timing."""
from __future__ import annotations

import asyncio

import pytest
from tests.test_bench_fakeserver import FakeOpenAIServer, chunk_plan

from kestrel.bench.client import ApiOptions, run_load, warmup
from kestrel.bench.datasets import BenchRequest
from kestrel.bench.metrics import distribution, parse_slo, reconcile_chunk_tokens, summarize, token_gaps, tpot
from kestrel.bench.server_info import parse_prometheus, spec_decode_stats
from kestrel.engine.messages import EngineStats
from kestrel.server.metrics import ServerMetrics
from kestrel.errors import KestrelError


def test_itl_spreads_a_multi_token_chunk_gap_over_its_tokens():
    # chunks at 1.0 (1 token), 1.1 (1), 1.4 (3 tokens), 1.5 (1)
    assert token_gaps([1.0, 1.1, 1.4, 1.5], [1, 1, 3, 1]) == pytest.approx([0.1, 0.1, 0.1, 0.1, 0.1])


def test_extra_tokens_of_the_first_chunk_have_zero_gaps_and_empty_chunks_are_skipped():
    assert token_gaps([0.5, 0.6, 0.8], [2, 0, 1]) == pytest.approx([0.0, 0.3])
    assert token_gaps([0.5], [1]) == []


def test_chunks_of_1_3_2_tokens_give_five_itl_values_not_two():
    # accepted drafts arrive together: 6 tokens in 3 chunks are 5 inter-token gaps, each chunk's gap shared
    itl = token_gaps([0.0, 0.3, 0.5], [1, 3, 2])
    assert itl == pytest.approx([0.1, 0.1, 0.1, 0.1, 0.1])
    record = {"ttft": 0.0, "e2e": 0.5, "output_tokens": 6}
    assert tpot(record) == pytest.approx(sum(itl) / len(itl))   # TPOT counts tokens too


def _spec_snapshot(drafts: int, draft_tokens: int, accepted: int, per_pos: tuple[int, ...]) -> dict[str, float]:
    """/metrics as a Kestrel server renders it for these cumulative totals."""
    stats = EngineStats(0, 0, 0.0, 0, 8, 0, 0, 0, 0, 0, spec_num_drafts=drafts, spec_num_draft_tokens=draft_tokens,
                        spec_num_accepted_tokens=accepted, spec_accepted_per_pos=per_pos)
    return parse_prometheus(ServerMetrics(lambda: stats, "m").render().decode())


def test_acceptance_rate_and_length_come_from_two_metrics_snapshots():
    before = _spec_snapshot(5, 15, 9, (4, 3, 2))
    after = _spec_snapshot(15, 45, 25, (12, 8, 5))   # the run: 10 drafts of 3 tokens, 16 accepted (8, 5, 3)
    spec = spec_decode_stats(before, after)
    assert spec["source"] == "kestrel"
    assert (spec["num_drafts"], spec["num_draft_tokens"], spec["num_accepted_tokens"]) == (10, 30, 16)
    assert spec["acceptance_rate"] == pytest.approx(16 / 30)
    assert spec["mean_accepted_length"] == pytest.approx(1 + 16 / 10)
    assert spec["num_accepted_tokens_per_pos"] == [8, 5, 3]
    assert spec["acceptance_rate_per_pos"] == pytest.approx([0.8, 0.5, 0.3])


def test_acceptance_fields_are_null_without_drafts_or_without_counters():
    idle = spec_decode_stats(_spec_snapshot(0, 0, 0, ()), _spec_snapshot(0, 0, 0, ()))
    assert idle["num_drafts"] == 0
    assert idle["acceptance_rate"] is idle["mean_accepted_length"] is idle["acceptance_rate_per_pos"] is None
    assert spec_decode_stats({}, parse_prometheus("kestrel:prompt_tokens_total 5\n")) is None
    assert spec_decode_stats(None, None) is None


def test_vllm_counters_are_read_the_same_way():
    text = ('vllm:spec_decode_num_drafts_total{model_name="x"} 4\n'
            'vllm:spec_decode_num_draft_tokens_total{model_name="x"} 8\n'
            'vllm:spec_decode_num_accepted_tokens_total{model_name="x"} 6\n'
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="x",position="0"} 4\n'
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="x",position="1"} 2\n')
    spec = spec_decode_stats(None, parse_prometheus(text))
    assert spec["source"] == "vllm" and spec["mean_accepted_length"] == pytest.approx(2.5)
    assert spec["acceptance_rate_per_pos"] == pytest.approx([1.0, 0.5])


def test_distribution_uses_linear_interpolation_percentiles():
    d = distribution(list(range(1, 101)), scale=2.0)
    assert d["mean"] == pytest.approx(101.0)
    assert d["p50"] == pytest.approx(101.0)
    assert d["p90"] == pytest.approx(2 * 90.1)
    assert d["p99"] == pytest.approx(2 * 99.01)
    assert (d["min"], d["max"]) == (2.0, 200.0)
    assert distribution([])["p99"] is None


def test_slo_parsing_names_the_bad_value():
    assert parse_slo("ttft:200,tpot:50") == {"ttft": 200.0, "tpot": 50.0}
    assert parse_slo(None) == {}
    with pytest.raises(KestrelError, match="latency:5"):
        parse_slo("latency:5")


def _record(ttft, e2e, tokens, success=True):
    return {"ttft": ttft, "e2e": e2e, "output_tokens": tokens, "prompt_tokens": 10, "itl": [], "success": success,
            "token_source": "usage", "error": None if success else "HTTP 500"}


def test_goodput_counts_requests_meeting_every_slo():
    records = [_record(0.1, 1.1, 11),    # TTFT 100 ms, TPOT 100 ms: meets both
               _record(0.3, 1.3, 11),    # TTFT 300 ms: misses ttft
               _record(0.1, 2.1, 11),    # TPOT 200 ms: misses tpot
               _record(None, 1.0, 0, success=False)]
    s = summarize(records, duration_s=2.0, slo=parse_slo("ttft:200,tpot:150"))
    assert s["completed"] == 3 and s["failed"] == 1
    assert s["goodput"] == pytest.approx(0.5)
    assert s["slo_attainment"] == pytest.approx(0.25)
    assert s["tpot_ms"]["p50"] == pytest.approx(100.0)
    assert s["output_throughput"] == pytest.approx(33 / 2.0)
    assert s["total_token_throughput"] == pytest.approx((33 + 30) / 2.0)
    assert s["request_throughput"] == pytest.approx(1.5)


def test_goodput_on_ttft_is_unknown_without_streaming():
    s = summarize([_record(None, 1.0, 10)], duration_s=1.0, slo={"ttft": 100.0})
    assert s["goodput"] is None
    assert summarize([_record(None, 1.0, 10)], 1.0, {"e2e": 2000.0})["goodput"] == pytest.approx(1.0)


TTFT, GAP, PATTERN, MAX_TOKENS = 0.15, 0.04, (1, 3), 9
TOL = 0.03   # scheduler jitter on 2 shared cores


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("usage", [True, False])
def test_streamed_timings_match_the_servers_known_schedule(endpoint, usage):
    plan = chunk_plan(MAX_TOKENS, TTFT, GAP, PATTERN)   # chunks of 1, 1, 3, 1, 3 tokens
    with FakeOpenAIServer(ttft_s=TTFT, gap_s=GAP, pattern=PATTERN, usage=usage) as server:
        api = ApiOptions(server.base_url, server.model, endpoint)
        # as `kestrel bench serve` does (--warmup-requests 1): the process's first request pays one-time client
        # costs (44 ms once on the 2-core CI box), which are not the schedule under test
        asyncio.run(warmup(api, [BenchRequest("hi", 1, MAX_TOKENS)], 1, 1))
        records, duration = asyncio.run(run_load(api, [BenchRequest("hi", 1, MAX_TOKENS)] * 2, concurrency=2,
                                                 progress=False))
    for r in records:
        assert r.success, r.error
        assert r.ttft == pytest.approx(TTFT, abs=TOL)
        assert r.e2e == pytest.approx(plan[-1][0], abs=TOL)
        assert r.chunk_tokens == ([k for _, k in plan] if usage else [1] * len(plan))
        if usage:   # with per-chunk usage: exact token accounting, ITL per token
            assert (r.output_tokens, r.token_source, r.prompt_tokens) == (MAX_TOKENS, "usage", 7)
            expected_itl = [GAP, GAP / 3, GAP / 3, GAP / 3, GAP, GAP / 3, GAP / 3, GAP / 3]
            assert r.itl == pytest.approx(expected_itl, abs=TOL / 2)
            assert sum(r.itl) / len(r.itl) == pytest.approx((r.e2e - r.ttft) / (MAX_TOKENS - 1), abs=TOL / 2)
        else:       # no usage, no tokenizer: one token per chunk is all the client can know
            assert (r.output_tokens, r.token_source) == (len(plan), "chunks")
    s = summarize([r.to_dict() for r in records], duration)
    assert s["ttft_ms"]["p50"] == pytest.approx(TTFT * 1000, abs=TOL * 1000)
    expected_tpot = (plan[-1][0] - TTFT) / ((MAX_TOKENS if usage else len(plan)) - 1)
    assert s["tpot_ms"]["mean"] == pytest.approx(expected_tpot * 1000, abs=TOL * 1000 / 2)
    assert duration == pytest.approx(plan[-1][0], abs=2 * TOL)


def test_non_streamed_requests_have_e2e_and_usage_but_no_ttft():
    with FakeOpenAIServer(ttft_s=0.1, gap_s=0.02) as server:
        api = ApiOptions(server.base_url, server.model, stream=False)
        (r,), _ = asyncio.run(run_load(api, [BenchRequest("hi", 1, 5)], progress=False))
    assert r.success and r.ttft is None and r.itl == []
    assert r.output_tokens == 5 and r.token_source == "usage"
    assert r.e2e == pytest.approx(chunk_plan(5, 0.1, 0.02, (1, 3))[-1][0], abs=TOL)


def test_server_errors_are_recorded_per_request_and_the_run_continues():
    with FakeOpenAIServer(ttft_s=0.01, gap_s=0.01, fail_every=2) as server:
        api = ApiOptions(server.base_url, server.model)
        records, duration = asyncio.run(run_load(api, [BenchRequest("hi", 1, 3)] * 4, concurrency=1,
                                                 progress=False))
    assert [r.success for r in records] == [True, False, True, False]
    assert "HTTP 500" in records[1].error
    assert summarize([r.to_dict() for r in records], duration)["failed"] == 2


def test_unreachable_server_is_an_error_per_request_not_a_crash():
    api = ApiOptions("http://127.0.0.1:9", "m", timeout_s=5)
    records, _ = asyncio.run(run_load(api, [BenchRequest("hi", 1, 3)], progress=False))
    assert not records[0].success and "Connect" in records[0].error


def test_chunk_token_estimates_are_reconciled_with_the_servers_total():
    assert reconcile_chunk_tokens([4, 1], 4) == [3, 1]          # re-tokenized text over-counted
    assert reconcile_chunk_tokens([2, 2, 1], 3) == [1, 1, 1]    # one token per chunk
    assert reconcile_chunk_tokens([1, 1, 1], 9) == [3, 3, 3]    # multi-token chunks, no per-chunk usage
    assert reconcile_chunk_tokens([1, 2], 3) == [1, 2]
    assert sum(reconcile_chunk_tokens([5, 1, 1, 2], 11)) == 11
