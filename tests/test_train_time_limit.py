"""`kestrel train-eagle3 --time-limit` bounds the whole run, the target's answers included, and the answers survive
a killed run: written one prompt at a time, reused by a rerun with the same data settings, regenerated when a
setting that decides them changes, and read back whatever a kill left at the end of the file."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kestrel.train.answers import Answered, AnswerStore
from kestrel.train.budget import ANSWER_SHARE, MAX_ANSWER_SHARE, MIN_ANSWER_SHARE, Budget, Pacer
from kestrel.train.trainer import TrainConfig, train_eagle3

REPO = Path(__file__).resolve().parents[1]
SNIPPETS = ["import os\n", "def main():\n", "class Foo:\n", "for i in range(10):\n", "# Copyright\n",
            "from typing import Any\n", "while True:\n", "with open(path) as f:\n", "try:\n",
            "if __name__ == '__main__':\n", "async def fetch(url):\n", "@dataclass\n"]


def prompts_file(path: Path, n: int) -> Path:
    """n distinct text prompts."""
    path.write_text("".join(json.dumps({"text": f"# {i}\n{SNIPPETS[i % len(SNIPPETS)]}"}) + "\n" for i in range(n)))
    return path


def config(out: Path, data: Path | None, **kw) -> TrainConfig:
    base = dict(output=str(out), data=None if data is None else str(data), max_new_tokens=16, draft_vocab_size=512,
                ttt_steps=2, epochs=1, batch_size=2, lr=1e-3, device="cpu", checkpoint_every=1000,
                engine_kwargs={"kv_cache_memory": 2**26})
    base.update(kw)
    return TrainConfig(**base)


def answer_lines(out: Path) -> dict[Path, list[str]]:
    """{answer file: its lines after the header}."""
    return {p: p.read_text().splitlines()[1:] for p in sorted((out / "work" / "answers").glob("*.jsonl"))}


def answered(out: Path) -> int:
    return sum(len(lines) for lines in answer_lines(out).values())


# ---- the budget -------------------------------------------------------------------------------------------------

class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_budget_gives_answers_half_the_limit_and_training_the_rest_but_the_save():
    clock = Clock()
    budget = Budget(600.0, started=clock.now, clock=clock)
    clock.now += 30   # loading
    assert budget.answers_deadline() == 100 + ANSWER_SHARE * 600
    clock.now = 100 + 400   # a loading that took most of the limit: the answers still get a share
    assert budget.answers_deadline() == 500 + MIN_ANSWER_SHARE * 600
    clock.now = 100 + 500
    assert budget.answers_deadline() == 100 + MAX_ANSWER_SHARE * 600   # but the save's time is kept
    clock.now = 130
    assert budget.answers_deadline(data_only=True) == 700   # nothing else to leave time for
    clock.now = 200   # the answers ended early (most were on disk): the states get half of what is left
    assert budget.states_deadline() == 200 + 250
    assert budget.train_deadline(10.0) == 690
    # --max-gen-time counts from the answers' start, capped at MAX_ANSWER_SHARE of the limit
    capped = Budget(600.0, max_answer_s=1000.0, started=100.0, clock=clock)
    assert capped.answers_deadline() == 100 + MAX_ANSWER_SHARE * 600
    assert Budget(None, max_answer_s=60.0, clock=clock).answers_deadline() == clock.now + 60
    assert Budget(None, clock=clock).answers_deadline() is None


def test_the_pacer_refuses_a_step_that_would_end_past_the_deadline():
    clock = Clock()
    pacer = Pacer(110.0, clock)
    assert pacer.fits()
    pacer.start()
    clock.now += 4   # a step of 4 s
    pacer.stop()
    assert pacer.fits()              # 104 + 4 <= 110
    clock.now += 3
    assert not pacer.fits() and pacer.cut   # 107 + 4 > 110: not started
    assert Pacer(None, clock).fits()


# ---- the answer file --------------------------------------------------------------------------------------------

def test_the_answer_file_survives_a_partial_last_line_and_a_corrupt_one(tmp_path):
    settings = {"max_new_tokens": 4}
    store = AnswerStore(tmp_path, settings)
    for i in range(4):
        store.append(Answered(i, f"h{i}", (1, 2), ((3 + i, 4),)))
    store.close()
    lines = store.path.read_text().splitlines()
    lines[2] = lines[2][:10]                                     # prompt 1's line corrupt
    store.path.write_text("\n".join(lines) + "\n" + '{"i": 4, "p": "h4", "prom')   # a kill mid-line
    again = AnswerStore(tmp_path, settings)
    found = again.load()
    assert sorted(found) == [0, 2, 3] and found[3].answers == ((6, 4),) and found[0].prompt == (1, 2)
    again.append(Answered(1, "h1", (1, 2), ((9,),)))              # appended on a clean line
    again.close()
    assert all(json.loads(line) for line in again.path.read_text().splitlines()[3:])
    assert sorted(AnswerStore(tmp_path, settings).load()) == [0, 1, 2, 3]
    # other settings: another file, this one untouched
    other = AnswerStore(tmp_path, {"max_new_tokens": 5})
    assert other.path != store.path and other.load() == {}
    # a file whose header is not this key's is never trusted
    store.path.write_text('{"kestrel_answers": 1, "key": "someone else"}\n' + store.path.read_text().split("\n", 1)[1])
    assert AnswerStore(tmp_path, settings).load() == {}


# ---- whole runs -------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_time_limit_shorter_than_the_answers_stops_them_and_still_writes_a_lossless_drafter(tmp_path):
    from kestrel.llm import LLM
    from kestrel.sampling_params import SamplingParams

    data = prompts_file(tmp_path / "p.jsonl", 400)
    limit = 20.0
    started = time.monotonic()
    # unlimited, this would answer 400 prompts of 48 tokens two at a time and train 50 epochs: minutes
    result = train_eagle3(config(tmp_path / "out", data, max_new_tokens=48, gen_batch_size=2, epochs=50,
                                 time_limit_s=limit), started=started)
    took = time.monotonic() - started
    # the margin: one step longer than the one before it (a training step takes seconds on a loaded 2-core box)
    assert took <= limit + 3.0, f"{took:.1f} s for a {limit} s limit"
    assert 0 < result.answers_generated < result.prompts_total == 400 and not result.finished
    assert result.seconds["answers"] <= ANSWER_SHARE * limit + 0.5   # the answers kept to their share
    assert result.steps > 0 and result.num_sequences > 0
    assert answered(tmp_path / "out") == result.answers_generated   # each answered prompt is on disk

    params = SamplingParams(max_tokens=12, temperature=0.0)
    prompts = ["import sys\n", "def f(x):\n"]
    plain = LLM(device="cpu", kv_cache_memory=2**26)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    plain.shutdown()
    spec = LLM(device="cpu", kv_cache_memory=2**26,
               speculative_config={"method": "eagle3", "model": str(result.output), "num_speculative_tokens": 3})
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params)]
    drafted = spec._require_engine().stats().spec_num_drafts
    spec.shutdown()
    assert got == want and drafted > 0


@pytest.mark.slow
def test_the_command_ends_within_its_time_limit_counted_from_the_process_start(tmp_path):
    limit_min = 0.4
    argv = [sys.executable, "-m", "kestrel.cli", "train-eagle3", "--output", str(tmp_path / "out"),
            "--self-distill", "400", "--max-new-tokens", "64", "--gen-batch-size", "4", "--epochs", "50",
            "--draft-vocab-size", "512", "--ttt-steps", "2", "--batch-size", "2", "--device", "cpu",
            "--time-limit", str(limit_min)]
    started = time.monotonic()
    done = subprocess.run(argv, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                          timeout=300)
    took = time.monotonic() - started
    assert done.returncode == 0, done.stderr[-2000:]
    # the margin: one step, and the interpreter's exit after the save (torch's teardown: seconds on a busy CPU)
    assert took <= 60 * limit_min + 6.0, f"{took:.1f} s for a {60 * limit_min:.0f} s limit"
    assert "rerun the same command to answer the rest" in done.stdout
    assert "the held-out measurement runs once the training is finished" in done.stdout
    assert (tmp_path / "out" / "model.safetensors").is_file()


@pytest.mark.slow
def test_a_killed_run_keeps_its_answers_and_the_rerun_answers_only_the_rest(tmp_path):
    data = prompts_file(tmp_path / "p.jsonl", 24)
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "kestrel.cli", "train-eagle3", "--output", str(out), "--data", str(data),
            "--max-new-tokens", "48", "--gen-batch-size", "2", "--draft-vocab-size", "512", "--ttt-steps", "2",
            "--epochs", "1", "--batch-size", "2", "--device", "cpu", "--skip-eval"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while answered(out) == 0:
            assert proc.poll() is None, "the run ended before its first answer was seen"
            assert time.monotonic() < deadline
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)   # mid-answers: no handler, no cleanup
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    kept = answered(out)
    assert 1 <= kept < 24, kept

    # the rerun (same data settings) reads them back and answers only the rest, then trains
    result = train_eagle3(config(out, data, max_new_tokens=48))
    assert result.answers_reused >= kept - 1   # a line the kill cut in half is answered again
    assert result.answers_generated == 24 - result.answers_reused < 24
    assert result.finished and result.num_sequences == 24
    assert answered(out) >= 24

    # a setting that decides the answers: a new file, all answered again; the old file stays
    longer = train_eagle3(config(out, data, max_new_tokens=20, gen_batch_size=2, data_only=True))
    assert longer.answers_reused == 0 and longer.answers_generated == 24 and len(answer_lines(out)) == 2
    # one that does not (the training's): everything reused
    same = train_eagle3(config(out, data, max_new_tokens=48, lr=5e-4, data_only=True))
    assert same.answers_generated == 0 and same.answers_reused == 24


@pytest.mark.slow
def test_a_rerun_adds_the_answers_left_and_trains_on_from_the_checkpoint(tmp_path):
    from tests.test_train_eagle3 import served_state

    data = prompts_file(tmp_path / "p.jsonl", 60)
    out = tmp_path / "out"
    # two at a time, the 60 answers take longer than the 3 s --max-gen-time (seconds a pair on a busy CPU)
    first = train_eagle3(config(out, data, max_new_tokens=48, gen_batch_size=2, max_gen_time_s=3.0))
    assert 0 < first.answers_generated < 60 and not first.finished and first.steps > 0
    vocabulary = served_state(out)["d2t"]
    second = train_eagle3(config(out, data, max_new_tokens=48))
    assert second.answers_reused == first.answers_generated and second.data_complete
    assert second.finished and second.steps > first.steps and second.num_sequences == 60
    assert torch.equal(served_state(out)["d2t"], vocabulary)   # the checkpoint's drafter keeps its vocabulary


def test_an_edited_prompt_file_regenerates_only_the_changed_prompts_and_the_answers_can_grow(tmp_path):
    data = prompts_file(tmp_path / "p.jsonl", 6)
    out = tmp_path / "out"
    first = train_eagle3(config(out, data, data_only=True))
    assert (first.answers_generated, first.answers_reused) == (6, 0) and first.finished
    lines = data.read_text().splitlines()
    lines[2] = json.dumps({"text": "print('changed')\n"})
    data.write_text("\n".join(lines + [json.dumps({"text": "x = 1\n"})]) + "\n")
    second = train_eagle3(config(out, data, data_only=True))
    assert (second.answers_generated, second.answers_reused) == (2, 5)


def test_a_target_without_chat_template_resumes_its_own_openings(tmp_path):
    target = tmp_path / "tiny-base"
    shutil.copytree(REPO / "models" / "kestrel-tiny", target)
    (target / "chat_template.jinja").unlink()
    tok_cfg = json.loads((target / "tokenizer_config.json").read_text())
    tok_cfg.pop("chat_template", None)
    (target / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    first = train_eagle3(config(tmp_path / "out", None, target=str(target), self_distill=5, data_only=True))
    assert first.answers_generated == first.prompts_total == 5
    more = train_eagle3(config(tmp_path / "out", None, target=str(target), self_distill=7, data_only=True))
    assert (more.answers_reused, more.answers_generated) == (5, 2)


def test_data_only_and_max_gen_time_from_the_command_line(tmp_path, capsys):
    from kestrel.cli import main

    data = prompts_file(tmp_path / "p.jsonl", 3)
    argv = ["train-eagle3", "--output", str(tmp_path / "out"), "--data", str(data), "--max-new-tokens", "8",
            "--device", "cpu", "--data-only", "--max-gen-time", "5"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "answers: 3 of 3 prompts (3 now, 0 from earlier runs)" in printed
    assert not (tmp_path / "out" / "model.safetensors").exists()   # no training
    assert main(argv) == 0 and "(0 now, 3 from earlier runs)" in capsys.readouterr().out
    assert main(["train-eagle3", "--output", "x", "--max-gen-time", "0"]) == 2
    assert "--max-gen-time must be positive" in capsys.readouterr().err
