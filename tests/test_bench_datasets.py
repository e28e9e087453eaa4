"""The benchmark's datasets say what they are: exact token lengths, distinct prompts, shared prefixes where asked.

The tokenizer is the embedded default model's (the one `kestrel serve` serves without a model argument).
"""
from __future__ import annotations

import io
import json

import pytest

from kestrel.bench.datasets import HEAD_LEN, DatasetConfig, build_requests
from kestrel.bench.progress import RunProgress
from kestrel.bench.tokenizer import BenchTokenizer
from kestrel.config import DEFAULT_MODEL_DIR
from kestrel.errors import KestrelError


@pytest.fixture(scope="module")
def tokenizer() -> BenchTokenizer:
    return BenchTokenizer(str(DEFAULT_MODEL_DIR))


def _build(tokenizer, num=50, token_prompts=True, seed=0, **flags):
    return build_requests(DatasetConfig(**flags), num, flags.get("input_len") or 1024,
                          flags.get("output_len") or 128, tokenizer, seed, token_prompts)


def test_random_token_prompts_have_exactly_the_stated_length_and_distinct_heads(tokenizer):
    reqs = _build(tokenizer, num=200, input_len=128, output_len=256)
    assert all(r.prompt_len == 128 == len(r.prompt) and r.output_len == 256 for r in reqs)
    assert len({tuple(r.prompt[:HEAD_LEN]) for r in reqs}) == 200    # no two prompts share a prefix
    allowed = set(tokenizer.prompt_token_ids)
    assert all(set(r.prompt) <= allowed for r in reqs)                 # no BOS/EOS/special tokens inside
    again = _build(tokenizer, num=200, input_len=128, output_len=256)
    other_seed = _build(tokenizer, num=200, input_len=128, output_len=256, seed=1)
    assert [r.prompt for r in again] == [r.prompt for r in reqs] != [r.prompt for r in other_seed]


def test_random_text_prompts_reencode_to_the_stated_length(tokenizer):
    # the chat endpoint takes text: decode, re-encode and fix up until the tokenizer counts exactly input_len
    reqs = _build(tokenizer, num=100, input_len=64, output_len=8, token_prompts=False)
    assert all(isinstance(r.prompt, str) and tokenizer.count(r.prompt) == r.prompt_len == 64 for r in reqs)
    assert len({r.prompt for r in reqs}) == 100


def test_random_range_ratio_bounds_lengths(tokenizer):
    reqs = _build(tokenizer, num=300, input_len=100, output_len=50, range_ratio=0.5)
    assert {len(r.prompt) for r in reqs} <= set(range(50, 151)) and len({len(r.prompt) for r in reqs}) > 20
    assert {r.output_len for r in reqs} <= set(range(25, 76))


def test_prefix_repetition_shares_stated_prefixes_before_distinct_suffixes(tokenizer):
    reqs = _build(tokenizer, num=12, name="prefix-repetition", prefix_repetition_prefix_len=40,
                  prefix_repetition_suffix_len=10, prefix_repetition_num_prefixes=3,
                  prefix_repetition_output_len=7)
    assert all(len(r.prompt) == r.prompt_len == 50 and r.output_len == 7 for r in reqs)
    prefixes = [tuple(r.prompt[:40]) for r in reqs]
    assert len(set(prefixes)) == 3 and all(prefixes.count(p) == 4 for p in set(prefixes))
    assert len({tuple(r.prompt[40:]) for r in reqs}) == 12
    assert DatasetConfig(name="prefix_repetition").name == "prefix-repetition"   # vLLM's spelling works too


def test_sharegpt_takes_first_turn_as_prompt_and_reply_length_as_output(tmp_path, tokenizer):
    long = "word " * 60
    rows = [{"conversations": [{"from": "human", "value": "Tell me about tokenizers please."},
                               {"from": "gpt", "value": long}]},
            {"messages": [{"role": "user", "content": "What is a prefix cache in serving?"},
                          {"role": "assistant", "content": "It reuses the attention keys of shared prompts."}]},
            {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": long}]},  # too short
            {"conversations": [{"from": "human", "value": "only one turn"}]}]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(rows))
    reqs = _build(tokenizer, num=4, name="sharegpt", path=str(path))
    assert {r.prompt for r in reqs} == {rows[0]["conversations"][0]["value"], rows[1]["messages"][0]["content"]}
    by_prompt = {r.prompt: r for r in reqs}
    assert by_prompt[rows[0]["conversations"][0]["value"]].output_len == tokenizer.count(long)
    assert all(r.prompt_len == tokenizer.count(r.prompt) for r in reqs)
    fixed = _build(tokenizer, num=2, name="sharegpt", path=str(path), sharegpt_output_len=9)
    assert {r.output_len for r in fixed} == {9}
    path.with_suffix(".jsonl").write_text("\n".join(json.dumps(r) for r in rows))   # JSON Lines as well
    assert len(_build(tokenizer, num=3, name="sharegpt", path=str(path.with_suffix(".jsonl")))) == 3


def test_dataset_flags_are_validated_with_their_names():
    with pytest.raises(KestrelError, match="--dataset-name 'sonnet' is invalid"):
        DatasetConfig(name="sonnet")
    with pytest.raises(KestrelError, match="--dataset-name sharegpt needs --dataset-path"):
        DatasetConfig(name="sharegpt")
    with pytest.raises(KestrelError, match="--random-input-len 0 is invalid"):
        DatasetConfig(input_len=0)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_progress_with_every_request_sent_at_once_shows_tokens_and_no_eta_from_one_finish():
    """128 requests sent at once, 256 tokens each, streamed: the line moves from the first second, the ETA comes
    from the steady token rate, and the first request to finish does not turn it into hours."""
    out, clock = io.StringIO(), FakeClock()
    progress = RunProgress("peak", total=128, out=out, expected_tokens=128 * 256, streamed=True, clock=clock)
    for _ in range(128):
        progress.request_sent()
    clock.now += 1.0                 # prefill: nothing streamed yet, yet a line after the first second
    progress.tick()
    assert out.getvalue() == "[peak] 0/128 finished, 128 in flight, 128/128 sent, 0/32768 tokens, elapsed 1s\n"
    progress.add_tokens(128)         # the first tokens: too early for a rate
    clock.now += 0.5
    assert "ETA" not in progress.line()
    clock.now += 0.5                 # 1 s of streaming at 128 tokens/s ... then 59 s more at the same rate
    progress.add_tokens(128 * 59)
    clock.now += 59
    progress.update(True)            # one request finishes a little before the others
    line = progress.line()
    assert line.startswith("[peak] 1/128 finished, 127 in flight, 128/128 sent, 7680/32768 tokens, elapsed 1m01s")
    assert line.endswith("ETA 3m16s")      # (32768 - 7680) tokens at 128 tokens/s, not 127 x 61 s = 2h09m


def test_progress_without_streaming_estimates_only_while_requests_still_wait():
    clock = FakeClock()
    progress = RunProgress("c=2", total=4, out=io.StringIO(), clock=clock)
    progress.request_sent(), progress.request_sent()    # the cap: two in flight, two waiting
    assert progress.line() == "[c=2] 0/4 finished, 2 in flight, 2/4 sent, elapsed 0s"
    clock.now += 10.0
    progress.update(True, tokens=16)    # at 10 s per request: 3 more take 30 s
    assert progress.line() == "[c=2] 1/4 finished, 1 in flight, 2/4 sent, 16 tokens, elapsed 10s, ETA 30s"
    progress.request_sent(), progress.request_sent()    # all sent: when they finish is not paced any more
    progress.update(False)
    assert "ETA" not in progress.line() and "1 failed, 2 in flight, 4/4 sent" in progress.line()
    assert "left" in RunProgress("d", total=None, duration_s=30.0).line()


def test_progress_on_a_log_writes_a_line_every_interval_and_a_final_one():
    out, clock = io.StringIO(), FakeClock()
    progress = RunProgress("peak", total=2, out=out, log_interval_s=10.0, clock=clock)
    progress.request_sent(), progress.request_sent()
    clock.now += 0.5
    progress.tick()
    assert out.getvalue() == ""          # not before the first second
    clock.now += 0.5
    progress.tick()
    clock.now += 5
    progress.tick()                      # then every 10 s
    clock.now += 5
    progress.tick()
    progress.update(True), progress.update(True)
    progress.close()
    assert [line.split(",")[0] for line in out.getvalue().splitlines()] == ["[peak] 0/2 finished"] * 2 + \
        ["[peak] 2/2 finished"]