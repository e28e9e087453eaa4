"""benchmarks/engine_bench.py's CPU-checkable parts: the bytes one decode step reads (the roofline's numerator),
the single-stream arithmetic (on a fake clock) and token count, the default road's timings on fresh prompts with
their prefix-cache hit rate (on the default model), and the graph capture size the graph memory is measured at."""
import pytest

from benchmarks.engine_bench import decode_weight_bytes, single_stream
from kestrel.config import EngineConfig
from kestrel.engine.engine import Engine
from kestrel.models.checkpoint import load_model_config, load_weights
from kestrel.models.registry import model_class


@pytest.mark.parametrize("tie", [False, True])
def test_decode_bytes_count_the_lm_head_and_one_embedding_row_not_an_untied_table(checkpoint_factory, tie):
    path = checkpoint_factory("llama", tie=tie)
    cfg = load_model_config(path)
    model = model_class(cfg)(cfg)
    load_weights(model, path)
    table = model.embed_tokens.weight
    all_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    row = table.shape[1] * table.element_size()
    expected = all_bytes if tie else all_bytes - table.numel() * table.element_size() + row
    assert decode_weight_bytes(model) == expected
    assert (model.lm_head.weight is table) == tie


class _ClockedEngine:
    """The engine interface run_requests drives, on a fake clock: a request's first step (its prefill) takes
    PREFILL_S and gives its first token, each later step DECODE_S and one token; every prompt is looked up in a
    fake prefix cache that serves HIT tokens of it."""
    PREFILL_S, DECODE_S, HIT = 10.0, 1.0, 4

    def __init__(self):
        self.now, self.live, self.queries, self.hits = 0.0, {}, 0, 0

    def clock(self) -> float:
        return self.now

    def add_request(self, rid, prompt, params):
        assert params.ignore_eos   # the bench promises max_tokens tokens a request
        self.live[rid] = [params.max_tokens, True]
        self.queries, self.hits = self.queries + len(prompt), self.hits + self.HIT

    def has_unfinished(self):
        return bool(self.live)

    def step(self):
        from types import SimpleNamespace
        (rid, state), = self.live.items()   # single_stream: one request at a time
        self.now += self.PREFILL_S if state[1] else self.DECODE_S
        state[0], state[1] = state[0] - 1, False
        if not state[0]:
            del self.live[rid]
        return [SimpleNamespace(request_id=rid, new_token_ids=[7], finished=not state[0])]

    def stats(self):
        from types import SimpleNamespace
        return SimpleNamespace(prefix_cache_queries=self.queries, prefix_cache_hits=self.hits)


def test_single_stream_counts_every_token_and_times_decode_apart_from_the_first(monkeypatch):
    """On a fake clock every figure is exact: 2 prompts x 6 tokens, each a 10 s prefill (the first token) and 5
    decode steps of 1 s. A bench that counted the first token as decode, or the prefill in the decode time, or lost
    a token, would be off."""
    from types import SimpleNamespace

    import benchmarks.engine_bench as engine_bench

    engine = _ClockedEngine()
    monkeypatch.setattr(engine_bench, "time", SimpleNamespace(perf_counter=engine.clock))
    r = single_stream(engine, [[5, 6, 7, 8], [9, 10, 11, 12]], max_tokens=6)
    assert r["output_tokens"] == 12 and r["prompts"] == 2
    assert r["tok_s"] == pytest.approx(12 / 30)           # all tokens / all wall time
    assert r["ms_per_token"] == pytest.approx(2500)
    assert r["decode_tok_s"] == pytest.approx(10 / 10)    # tokens after the first / time after the first token
    assert r["ttft_ms_mean"] == pytest.approx(10_000)
    assert r["prefix_cache_hit_rate"] == pytest.approx(8 / 8)   # what the engine's counters say, passed on
    assert r["prefix_cache_hit_tokens"] == 8 and r["prefix_cache_query_tokens"] == 8


def test_single_stream_on_a_real_engine_gets_max_tokens_from_each_fresh_prompt(checkpoint_factory):
    from kestrel.bench.fresh import FreshPrompts

    engine = Engine(EngineConfig(model=str(checkpoint_factory("llama")), device="cpu"))
    vocab = engine.runner.cfg.vocab_size
    r = single_stream(engine, FreshPrompts(vocab).take(2, 20), max_tokens=6)
    assert r["output_tokens"] == 12   # ignore_eos: no early stop shortens the work
    assert r["prefix_cache_hit_rate"] == 0.0 and r["prefix_cache_query_tokens"] == 40
    assert r["ms_per_token"] == pytest.approx(1000 / r["tok_s"])


def test_default_road_times_fresh_prompts_and_says_so():
    """engine_bench's own sequence (warm-ups, TTFT, bs1, concurrent) on the CPU with the default model at small
    sizes: every timed part reports a prefix-cache hit rate of 0.0; and the helpers do see hits when the old
    method (one prompt re-sent, or the warm-up's prompts timed again) is fed to them, so 0.0 is a measurement."""
    from benchmarks.engine_bench import default_road, throughput, ttft
    from kestrel.bench.fresh import FreshPrompts
    from kestrel.config import DEFAULT_MODEL_DIR

    engine = Engine(EngineConfig(model=str(DEFAULT_MODEL_DIR), device="cpu"))
    fresh = FreshPrompts(engine.runner.cfg.vocab_size)
    results = {}
    row = default_road(engine, fresh, results, concurrency=3, output_len=3, prompt_len=40, bs1_prompts=2,
                       ttft_runs=3)
    assert results["ttft_128_prefix_cache_hit_rate"] == 0.0 and results["ttft_128_ms"] > 0
    assert results["ttft_prompt_len"] == 40 and results["ttft_runs"] == 3
    assert row["bs1"]["prefix_cache_hit_rate"] == 0.0 and row["bs1"]["output_tokens"] == 2 * 3
    assert row["c128"]["prefix_cache_hit_rate"] == 0.0 and row["c128"]["output_tokens"] == 3 * 3
    assert row["c128"]["prefix_cache_query_tokens"] == 3 * 40
    # the old TTFT: one prompt five times; 40 tokens = 2 full blocks, of which the cache serves 32 (never all)
    one = fresh.one(40)
    assert ttft(engine, [one] * 5)["prefix_cache_hit_rate"] == pytest.approx(4 * 32 / (5 * 40))
    # the old concurrent run: timed on the prompts its warm-up had just sent
    conc = fresh.take(3, 40)
    throughput(engine, conc, 2)
    assert throughput(engine, conc, 3)["prefix_cache_hit_rate"] == pytest.approx(32 / 40)


def test_graph_memory_is_measured_at_the_default_servers_capture_size():
    """The CUDA graph memory figure: decode graphs to the default server's batch (EngineConfig's 256), unless
    --cuda-graph-max-bs says otherwise; the child process gets the flag."""
    from pathlib import Path

    from benchmarks.engine_bench import build_parser, child_command, cuda_graph_max_bs

    parser = build_parser()
    assert cuda_graph_max_bs(parser.parse_args([])) == EngineConfig().cuda_graph_max_bs == 256
    assert cuda_graph_max_bs(parser.parse_args(["--concurrency", "512"])) == 512
    args = parser.parse_args(["--cuda-graph-max-bs", "128"])
    assert cuda_graph_max_bs(args) == 128
    child = parser.parse_args(child_command(args, "qwen3-0.6b", "kestrel", Path("o.json"), "/tmp/w")[3:])
    assert cuda_graph_max_bs(child) == 128


def test_the_per_model_children_get_the_tensor_parallel_flags():
    """The default mode runs each model in a child process: the flags that shape the engine must reach it."""
    from pathlib import Path

    from benchmarks.engine_bench import build_parser, child_command

    parser = build_parser()
    args = parser.parse_args(["--models", "llama-3.1-8b", "--skip-hf", "--graphs-only", "--tensor-parallel-size",
                              "4", "--disable-custom-all-reduce", "--quantization", "fp8", "--prefix-bench", "none",
                              "--fp8-checkpoint", "block"])
    child = parser.parse_args(child_command(args, "llama-3.1-8b", "kestrel", Path("o.json"), "/tmp/w")[3:])
    assert child.in_process and child.only == "kestrel" and child.graphs_only
    assert child.tensor_parallel_size == 4 and child.disable_custom_all_reduce and child.quantization == "fp8"
    assert child.fp8_checkpoint == "block"
    plain = parser.parse_args(child_command(parser.parse_args([]), "qwen3-0.6b", "hf", Path("o.json"), "/tmp/w")[3:])
    assert plain.tensor_parallel_size == 1 and not plain.disable_custom_all_reduce and plain.fp8_checkpoint is None
