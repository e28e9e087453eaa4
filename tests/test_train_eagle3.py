"""`kestrel train-eagle3`: the trainable drafter is the serving drafter (same logits after save and load, step by
step of the training-time test), the loss scores each step against the right target position, the output is the
standard format, and training is deterministic and resumable."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from kestrel.attention.torch_ref import TorchAttentionBackend
from kestrel.errors import KestrelError
from kestrel.batch import build_forward_batch
from kestrel.models.eagle3_loader import REQUIRED_TENSORS, drafter_config_json, eagle3_config, load_eagle3_drafter
from kestrel.models.llama import LlamaForCausalLM
from kestrel.models.model_config import ModelConfig
from kestrel.train.data import Sample, load_prompts
from kestrel.train.drafter import TrainableEagle3, ttt_loss
from kestrel.train.trainer import TrainConfig, save_drafter, train_eagle3
from kestrel.train.vocab import coverage, select_draft_vocab, token_counts
from tests.tolerances import scaled

TARGET = ModelConfig(architecture="LlamaForCausalLM", vocab_size=96, hidden_size=48, intermediate_size=64,
                     num_layers=6, num_heads=4, num_kv_heads=2, head_dim=12, rms_norm_eps=1e-5, rope_theta=10000.0,
                     rope_scaling=None, max_position_embeddings=128, tie_word_embeddings=False, qkv_bias=False,
                     qk_norm=False, sliding_window=None, torch_dtype=None)
BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def target() -> LlamaForCausalLM:
    torch.manual_seed(1)
    model = LlamaForCausalLM(TARGET)
    model.embed_tokens.weight.data.normal_()
    return model


def trainable(tmp_path: Path, target: LlamaForCausalLM, draft_vocab: int = 40) -> tuple[TrainableEagle3, Path]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(drafter_config_json(TARGET, draft_vocab)))
    cfg = eagle3_config(tmp_path, TARGET)
    draft_ids = torch.randperm(TARGET.vocab_size, generator=torch.Generator().manual_seed(0))[:draft_vocab].sort()[0]
    model = TrainableEagle3(cfg, target.embed_tokens.weight.detach(), draft_ids)
    with torch.no_grad():   # norms away from 1 and larger weights, so a misplaced norm or shift shows
        for name, p in model.named_parameters():
            p.add_(0.3 * torch.randn_like(p)) if p.dim() == 1 else p.mul_(5.0)
    return model, tmp_path / "config.json"


def test_unrolled_steps_equal_the_serving_drafter_after_save_and_load(tmp_path, target):
    model, config_path = trainable(tmp_path / "cfg", target)
    save_drafter(model, tmp_path / "out", config_path)
    served = load_eagle3_drafter(tmp_path / "out", TARGET, target, "cpu", torch.float32)
    # bf16 on disk: compare with the trainable drafter holding the same rounded weights
    model.load_state_dict({n: t.float() if t.is_floating_point() else t
                           for n, t in served_state(tmp_path / "out").items()}, strict=False)
    assert torch.equal(served.draft_to_target(torch.arange(40)), model.draft_ids)

    g = torch.Generator().manual_seed(2)
    lengths, steps = [11, 7], 3
    t = max(lengths)
    ids = torch.randint(0, TARGET.vocab_size, (2, t), generator=g)
    aux = torch.randn(2, t, 3 * TARGET.hidden_size, generator=g)
    valid = torch.arange(t)[None] < torch.tensor(lengths)[:, None]
    with torch.no_grad():
        unrolled = model.unroll(aux, ids, valid, steps)

    backend = TorchAttentionBackend()
    for s, n in enumerate(lengths):
        for last in range(1, n - steps - 1):   # an extend over rows 0..last, then steps - 1 draft steps
            cache = torch.zeros(served.kv_cache_shape(8, BLOCK_SIZE))
            blocks = [list(range(8))]
            batch = build_forward_batch([ids[s, 1:last + 2].tolist()], [0], blocks, BLOCK_SIZE)
            normed, out = served(batch, aux[s, :last + 1], backend, (cache[0], cache[1]))
            got = [served.compute_logits(normed)[0]]
            hidden = out[-1:]
            for step in range(1, steps):
                batch = build_forward_batch([[int(ids[s, last + step + 1])]], [last + step], blocks, BLOCK_SIZE)
                normed, hidden = served(batch, hidden, backend, (cache[0], cache[1]))
                got.append(served.compute_logits(normed)[0])
            for step in range(steps):
                torch.testing.assert_close(got[step], unrolled[step][s, last],
                                           **scaled(dict(atol=2e-4, rtol=2e-4), unrolled[step][s, last]))


def served_state(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_the_loss_scores_step_i_row_t_against_the_target_at_t_plus_i_plus_1():
    g = torch.Generator().manual_seed(0)
    b, t, vocab, steps = 2, 9, 12, 3
    draft_ids = torch.arange(0, vocab, 2)          # the even target ids
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[draft_ids] = True
    target_logits = torch.randn(b, t, draft_ids.numel(), generator=g) * 3
    best = draft_ids[target_logits.argmax(-1)]
    loss_mask = torch.zeros(b, t, dtype=torch.bool)
    loss_mask[:, 3:] = True
    # a perfect drafter: step i's row t holds the target's logits at t + i + 1
    perfect = [torch.nn.functional.pad(target_logits[:, i + 1:], (0, 0, 0, i + 1)) for i in range(steps)]
    loss, losses, accs = ttt_loss(perfect, target_logits, best, loss_mask, t2d, draft_ids)
    assert accs == [1.0] * steps
    p = target_logits.softmax(-1)
    entropy = -(p * p.log()).sum(-1)
    for i in range(steps):   # rows t with token t + i + 2 in the answer: t + i + 2 >= 3 and t + i + 2 < T
        rows = [(bb, r) for bb in range(b) for r in range(t) if 3 <= r + i + 2 < t]
        want = torch.stack([entropy[bb, r + i + 1] for bb, r in rows]).mean()
        assert losses[i] == pytest.approx(float(want), rel=1e-5)
    shifted_wrong = [torch.nn.functional.pad(target_logits[:, i:], (0, 0, 0, i)) for i in range(steps)]
    assert ttt_loss(shifted_wrong, target_logits, best, loss_mask, t2d, draft_ids)[2][0] < 1.0
    # a target choice outside the draft vocabulary carries no loss: no draft could match it
    odd = best.clone()
    odd[:, :] = 1
    assert ttt_loss(perfect, target_logits, odd, loss_mask, t2d, draft_ids)[1] == [0.0] * steps


def test_draft_vocabulary_keeps_the_most_frequent_answer_tokens():
    samples = [Sample((5, 6, 7, 7, 7, 3, 3), 2), Sample((9, 9, 3, 1), 1)]   # answers: 7 7 7 3 3 | 9 3 1
    counts = token_counts(samples, 10)
    assert counts.tolist() == [0, 1, 0, 3, 0, 0, 0, 3, 0, 1]
    ids = select_draft_vocab(counts, 3)
    assert ids.tolist() == [1, 3, 7]   # 3 and 7 (3 each), then the lower of the ones seen once
    assert coverage(counts, ids) == pytest.approx(7 / 8)
    assert select_draft_vocab(counts, 50).tolist() == list(range(10))


def test_prompt_files_in_every_shape_and_their_errors(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "dropped"}]},
        {"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"},
                           {"from": "human", "value": "c"}]},
        {"prompt": "def f():"}, {"text": "import os"}]) + "\n\n")
    prompts = load_prompts(path)
    assert prompts[0].messages == ({"role": "user", "content": "hi"},)
    assert [m["role"] for m in prompts[1].messages] == ["user", "assistant", "user"]
    assert prompts[2].text == "def f():" and prompts[3].text == "import os"
    for bad, message in [("{not json", "not valid JSON"), ('{"other": 1}', "expected"),
                         ('{"messages": [{"role": "assistant", "content": "x"}]}', "no user turn")]:
        path.write_text(bad + "\n")
        with pytest.raises(KestrelError, match=message):
            load_prompts(path)
    with pytest.raises(KestrelError, match="not found"):
        load_prompts(tmp_path / "missing.jsonl")


def _train(out: Path, data: Path, **kw) -> object:
    cfg = dict(output=str(out), data=str(data), max_new_tokens=12, draft_vocab_size=512, ttt_steps=2, epochs=3,
               batch_size=2, lr=1e-3, device="cpu", checkpoint_every=100, engine_kwargs={"kv_cache_memory": 2**26})
    cfg.update(kw)
    return train_eagle3(TrainConfig(**cfg))


@pytest.fixture(scope="module")
def code_prompts(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "prompts.jsonl"
    snippets = ["import os\n", "def main():\n", "class Foo:\n    def __init__(self):\n", "for i in range(10):\n",
                "# Copyright\n", "from typing import Any\n"]
    path.write_text("".join(json.dumps({"text": s}) + "\n" for s in snippets))
    return path


@pytest.mark.slow
def test_training_writes_the_standard_format_deterministically_and_resumes_to_the_same_loss(tmp_path, code_prompts):
    full = _train(tmp_path / "a", code_prompts)
    assert full.finished and full.steps == 9 and full.num_sequences == 6
    again = _train(tmp_path / "b", code_prompts)
    assert again.final_loss == full.final_loss
    # interrupted after 4 steps, then the same command again
    part = _train(tmp_path / "c", code_prompts, stop_after=4)
    assert not part.finished and part.steps == 4 and (tmp_path / "c" / "model.safetensors").exists()
    resumed = _train(tmp_path / "c", code_prompts)
    assert resumed.finished and resumed.steps == 9 and resumed.final_loss == full.final_loss
    a, c = served_state(tmp_path / "a"), served_state(tmp_path / "c")
    assert a.keys() == c.keys() and all(torch.equal(a[k], c[k]) for k in a)

    # the standard format: exactly these tensors (the embedding is the target's), d2t/t2d consistent
    names = set(a)
    assert names == set(REQUIRED_TENSORS) | {"d2t", "t2d"}
    assert a["d2t"].dtype == torch.int64 and a["t2d"].dtype == torch.bool
    draft_ids = torch.arange(a["d2t"].numel()) + a["d2t"]
    assert bool(a["t2d"][draft_ids].all()) and int(a["t2d"].sum()) == draft_ids.numel()
    raw = json.loads((tmp_path / "a" / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLMEagle3"] and raw["draft_vocab_size"] == draft_ids.numel()
    assert raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]   # kestrel-tiny: 8 layers

    # other settings on a resumed directory are refused, not silently mixed
    with pytest.raises(KestrelError, match="other settings"):
        _train(tmp_path / "c", code_prompts, lr=5e-4)


@pytest.mark.slow
def test_a_trained_drafter_serves_with_greedy_output_unchanged(tmp_path, code_prompts):
    from kestrel.llm import LLM
    from kestrel.sampling_params import SamplingParams
    from kestrel.train.evaluate import evaluate_drafter

    result = _train(tmp_path / "d", code_prompts, epochs=1)
    params = SamplingParams(max_tokens=24, temperature=0.0)
    plain = LLM(device="cpu", kv_cache_memory=2**26)
    want = [o.outputs[0].token_ids for o in plain.generate(["import sys\n", "def f(x):\n"], params)]
    plain.shutdown()
    spec = LLM(device="cpu", kv_cache_memory=2**26, speculative_algorithm="EAGLE3",
               speculative_draft_model_path=str(result.output))
    got = [o.outputs[0].token_ids for o in spec.generate(["import sys\n", "def f(x):\n"], params)]
    spec.shutdown()
    assert got == want
    ev = evaluate_drafter(None, load_prompts(code_prompts)[:2], str(result.output), max_new_tokens=16,
                          device="cpu", kv_cache_memory=2**26)
    assert ev.verify_steps > 0 and len(ev.per_position) == 3 and 1.0 <= ev.acceptance_length <= 4.0
    assert ev.acceptance_length == pytest.approx(1 + sum(ev.per_position))


@pytest.mark.parametrize("argv, message", [
    (["train-eagle3", "--output", "x", "--data", "/no/such.jsonl"], "/no/such.jsonl not found"),
    (["train-eagle3", "--output", "x", "--samples-per-prompt", "2"], "needs --gen-temperature > 0"),
    (["train-eagle3", "--output", "x", "--epochs", "0"], "--epochs must be at least 1"),
    (["train-eagle3", "--output", "x", "--time-limit", "0"], "--time-limit must be positive"),
    (["eval-drafter", "--target", "/no/such/model"], "eagle3 needs the drafter's directory"),
])
def test_cli_refuses_bad_options_with_one_line(argv, message, capsys):
    from kestrel.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err
