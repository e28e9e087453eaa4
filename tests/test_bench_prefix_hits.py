"""The speculative benches (benchmarks/spec_bench.py, benchmarks/drafter_bench.py) on the CPU with the default model
and its tiny EAGLE-3 drafter at small sizes: every timed row says its prefix-cache hit rate (0.0 where the bench
promises fresh prompts) and its output token count, and rows compared in a ratio did the same work."""
from __future__ import annotations

from kestrel.config import DEFAULT_MODEL_DIR

DRAFTER = DEFAULT_MODEL_DIR.parent / "kestrel-tiny-eagle3"


def test_spec_bench_offline_rows_are_fresh_and_the_same_work():
    from benchmarks.spec_bench import bench_offline

    prompt_len, output_len, concurrency, bs1_prompts = 24, 4, 2, 1
    out = bench_offline(DEFAULT_MODEL_DIR, DRAFTER, 2, output_len, tree_topk=2, device="cpu", prompt_len=prompt_len,
                        concurrency=concurrency, bs1_prompts=bs1_prompts)
    bs1_rows = [out["plain"]["bs1"], *out["bs1_fixed"], *out["bs1_adaptive"], *out["bs1_tree"]]
    c_rows = [out["plain"]["c128"], *out["c128_adaptive"]]
    assert len(bs1_rows) == 1 + 4 + 2 + 2 and len(c_rows) == 1 + 2
    for row in bs1_rows:   # with and without speculation: the same tokens (ignore_eos), from prompts never sent
        assert row["prefix_cache_hit_rate"] == 0.0, row
        assert row["prefix_cache_query_tokens"] == bs1_prompts * prompt_len
        assert row["output_tokens"] == bs1_prompts * output_len
    for row in c_rows:
        assert row["prefix_cache_hit_rate"] == 0.0, row
        assert row["output_tokens"] == concurrency * output_len
    assert out["step_split_prefix_cache_hit_rate"] == 0.0
    assert out["workload"]["ignore_eos"] and out["workload"]["prompt_len"] == prompt_len


def test_drafter_bench_runs_generate_the_same_tokens_a_prompt_and_say_their_hit_rate():
    """--lengths matched: the run without speculation answers to EOS, every speculative run generates exactly as
    many tokens a prompt (before, EOS ended each run where its own text did: 671 vs 849 tokens on the GPU)."""
    from benchmarks.drafter_bench import offline
    from kestrel.train.data import instruction_prompts
    from kestrel.train.prompts import held_out_prompts

    prompts = instruction_prompts(held_out_prompts(2, seed=1))
    out = offline(None, str(DRAFTER), 2, 2, prompts, 6, device="cpu", only=("ngram_k2",))
    assert list(out) == ["none", "ngram_k2"]
    none = out["none"]
    assert not none["ignore_eos"] and out["ngram_k2"]["ignore_eos"]
    for row in out.values():
        assert row["output_tokens_per_prompt"] == none["output_tokens_per_prompt"]
        assert row["output_tokens"] == sum(none["output_tokens_per_prompt"])
        assert isinstance(row["prefix_cache_hit_rate"], float) and row["prefix_cache_query_tokens"] > 0


def test_drafter_bs1_fixed_lengths_and_a_repeated_prompt_shows_its_hits():
    from benchmarks.drafter_bench import bs1
    from kestrel.bench.fresh import FreshPrompts
    from kestrel.llm import LLM

    llm = LLM(str(DEFAULT_MODEL_DIR), device="cpu")
    try:
        p, q = FreshPrompts(llm.engine.runner.cfg.vocab_size, seed=5).take(2, 40)
        row = bs1(llm, [p, q], 8, lengths=[3, 5])
        assert row["output_tokens_per_prompt"] == [3, 5] and row["output_tokens"] == 8
        assert row["prefix_cache_hit_rate"] == 0.0   # the warm-up shares nothing with the timed prompts
        again = bs1(llm, [p, p], 8, lengths=[2, 2])  # the same prompt re-sent: the bench says so
        assert again["prefix_cache_hit_rate"] == 1.0 * 32 / 40
    finally:
        llm.shutdown()
