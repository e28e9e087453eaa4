"""What a router reads from `kestrel serve` (server/router_info.py): /v1/loads, /server_info, /model_info and the
/get_ forms, in the schema SGLang's routers (smg, sglang-router) parse — on a real server on loopback."""
from __future__ import annotations

import threading

import httpx
import openai
import pytest

from kestrel.config import EngineConfig
from kestrel.engine.messages import EngineLimits, EngineStats
from kestrel.server.app import ServerConfig
from kestrel.server.router_info import ThroughputMeter, WorkerIdentity, loads_body
from tests.test_server import LiveServer

pytestmark = pytest.mark.slow   # live servers started and shut down per test

# smg's SchedulerLoadSnapshot: integers where it deserializes i32 (a float there fails the whole response)
INT_FIELDS = ("dp_rank", "num_running_reqs", "num_waiting_reqs", "num_total_reqs", "num_used_tokens",
              "max_total_num_tokens", "max_running_requests", "num_total_tokens")
FLOAT_FIELDS = ("token_usage", "gen_throughput", "cache_hit_rate", "utilization")


@pytest.fixture(scope="module")
def checkpoint(checkpoint_factory):
    return checkpoint_factory("llama")


@pytest.fixture(scope="module")
def server(checkpoint):
    with LiveServer(EngineConfig(model=str(checkpoint), device="cpu", max_num_seqs=8)) as s:
        yield s


def test_loads_answer_in_sglangs_schema_with_the_engines_numbers(server):
    body = httpx.get(f"{server.url}/v1/loads", params={"include": "core,disagg,queues,memory"}).json()
    assert body["dp_rank_count"] == 1 and len(body["loads"]) == 1 and body["timestamp"]
    entry = body["loads"][0]
    assert all(type(entry[k]) is int for k in INT_FIELDS), entry
    assert all(type(entry[k]) is float for k in FLOAT_FIELDS), entry
    limits = server.engine.limits
    assert entry["max_total_num_tokens"] == limits.kv_capacity_tokens
    assert entry["max_running_requests"] == 8
    assert body["aggregate"]["total_reqs"] == entry["num_total_reqs"]
    # another rank than 0: no entry (Kestrel has one)
    assert httpx.get(f"{server.url}/v1/loads", params={"dp_rank": 1}).json()["loads"] == []
    # the older routers' /get_load (sglang-router 0.3 sums num_tokens over the list)
    legacy = httpx.get(f"{server.url}/get_load").json()
    assert legacy == [{"dp_rank": 0, "num_reqs": entry["num_running_reqs"],
                       "num_waiting_reqs": entry["num_waiting_reqs"], "num_tokens": entry["num_used_tokens"]}]


def test_loads_count_requests_in_flight_and_return_to_idle(server):
    api = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    seen: list[dict] = []
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            seen.append(httpx.get(f"{server.url}/v1/loads").json()["loads"][0])

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        stream = api.completions.create(model=api.models.list().data[0].id, prompt="def main(", max_tokens=64,
                                        stream=True, extra_body={"ignore_eos": True})
        for _ in stream:
            pass
    finally:
        done.set()
        poller.join()
    assert any(s["num_running_reqs"] + s["num_waiting_reqs"] >= 1 for s in seen)
    assert any(s["num_used_tokens"] > 0 and s["token_usage"] > 0 for s in seen)
    idle = httpx.get(f"{server.url}/v1/loads").json()["loads"][0]
    assert idle["num_running_reqs"] == idle["num_waiting_reqs"] == 0


def test_server_and_model_info_name_the_served_model_and_its_limits(server, checkpoint):
    for path in ("/server_info", "/get_server_info"):
        info = httpx.get(server.url + path).json()
        assert info["served_model_name"] == checkpoint.name and info["model_path"] == str(checkpoint.resolve())
        assert info["context_length"] == server.engine.max_model_len
        assert info["max_total_num_tokens"] == server.engine.limits.kv_capacity_tokens
        assert (info["tp_size"], info["dp_size"], info["max_running_requests"]) == (1, 1, 8)
    for path in ("/model_info", "/get_model_info"):
        info = httpx.get(server.url + path).json()
        assert info["is_generation"] is True and info["model_path"] == str(checkpoint.resolve())


def test_router_endpoints_need_the_api_key_when_one_is_set(checkpoint):
    with LiveServer(EngineConfig(model=str(checkpoint), device="cpu"), ServerConfig(api_key="sesame")) as s:
        for path in ("/v1/loads", "/get_load", "/server_info", "/model_info"):
            assert httpx.get(s.url + path).status_code == 401
            assert httpx.get(s.url + path, headers={"Authorization": "Bearer sesame"}).status_code == 200


def test_load_counts_are_capped_by_the_requests_in_flight():
    """The engine's last snapshot still counts what its last step finished; an idle server reports 0."""
    identity = WorkerIdentity("m", "/m", "/m", block_size=16, max_num_seqs=4, tensor_parallel_size=1)
    limits = EngineLimits(max_model_len=256, vocab_size=100, kv_capacity_tokens=1024)
    stats = EngineStats(num_running=3, num_waiting=2, kv_cache_usage=0.25, num_used_blocks=16, num_total_blocks=64,
                        num_preemptions=0, prompt_tokens_total=10, generation_tokens_total=5,
                        prefix_cache_queries=100, prefix_cache_hits=40)
    entry = loads_body(identity, limits, stats, 0.0, in_flight=4)["loads"][0]
    assert (entry["num_running_reqs"], entry["num_waiting_reqs"]) == (3, 1)
    assert entry["num_used_tokens"] == 256 and entry["cache_hit_rate"] == 0.4 and entry["utilization"] == 0.75
    idle = loads_body(identity, limits, stats, 0.0, in_flight=0)["loads"][0]
    assert (idle["num_running_reqs"], idle["num_waiting_reqs"], idle["utilization"]) == (0, 0, 0.0)


def test_throughput_is_tokens_per_second_between_polls():
    meter = ThroughputMeter()
    assert meter.update(100, now=10.0) == 0.0
    assert meter.update(300, now=12.0) == 100.0
    assert meter.update(400, now=12.1) == 100.0   # too close to the last poll: the previous rate


def test_a_non_streamed_request_cut_by_shutdown_is_a_503_a_router_can_retry(checkpoint):
    """SIGTERM aborts what is in flight; an answer not yet sent becomes a 503 (retryable) rather than a 200 cut short
    with finish_reason "abort", which a router would pass on."""
    live = LiveServer(EngineConfig(model=str(checkpoint), device="cpu"))
    with live:
        answer: list[httpx.Response] = []
        request = threading.Thread(target=lambda: answer.append(httpx.post(
            f"{live.url}/v1/completions", timeout=60,
            json={"prompt": "def main(", "max_tokens": 200, "ignore_eos": True})))
        request.start()
        while live.engine.num_in_flight() == 0:
            request.join(timeout=0.01)
        live.server.request_exit()
        request.join(timeout=30)
    assert answer[0].status_code == 503, answer[0].text
    assert answer[0].json()["error"]["code"] == "shutting_down"
