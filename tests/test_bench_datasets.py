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


def test_progress_shows_eta_only_once_requests_finish():
    out = io.StringIO()
    progress = RunProgress("peak", total=4, out=out, log_interval_s=0.0)
    assert progress.line().startswith("[peak] 0/4 finished, elapsed ") and "ETA" not in progress.line()
    progress.start -= 10.0          # 10 s in, the first request finishes: 3 more at that rate take 30 s
    progress.update(True)
    assert "1/4 finished" in progress.line() and "ETA 30s" in progress.line()
    progress.update(False)
    progress.close()
    assert out.getvalue().splitlines()[-1].startswith("[peak] 2/4 finished, 1 failed, elapsed 10s")
    assert "ETA" not in RunProgress("d", total=None, duration_s=30.0).line()

