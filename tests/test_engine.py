"""Engine behaviour: stop rules, n samples, seeds, logprobs, and clear errors for bad input."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from safetensors.torch import load_file, save_file

from kestrel import LLM, SamplingParams
from kestrel.errors import KestrelError, ModelLoadError


@pytest.fixture(scope="module")
def llm(checkpoint_factory):
    return LLM(model=str(checkpoint_factory("llama")), device="cpu")


def greedy(llm, prompt, **kw):
    return llm.generate(prompt, SamplingParams(temperature=0, **kw))[0].outputs[0]


def test_max_tokens_gives_length(llm):
    out = greedy(llm, "import os", max_tokens=5, ignore_eos=True)
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_stop_token_id_finishes_with_stop(llm):
    first = greedy(llm, "import os", max_tokens=3, ignore_eos=True).token_ids
    out = greedy(llm, "import os", max_tokens=10, stop_token_ids=[first[1]], ignore_eos=True)
    assert out.token_ids == first[:2] and out.finish_reason == "stop"


def test_eos_stops_unless_ignored(llm):
    first = greedy(llm, "import os", max_tokens=3, ignore_eos=True).token_ids
    llm.engine.eos_token_ids = frozenset({first[0]})
    try:
        assert greedy(llm, "import os", max_tokens=3).finish_reason == "stop"
        assert len(greedy(llm, "import os", max_tokens=3, ignore_eos=True).token_ids) == 3
        assert len(greedy(llm, "import os", max_tokens=3, min_tokens=3).token_ids) == 3
    finally:
        llm.engine.eos_token_ids = frozenset(llm.tokenizer.eos_token_ids)


def test_stop_string_truncates_text(llm):
    full = greedy(llm, "import os", max_tokens=12, ignore_eos=True)
    stop = full.text[3:6]
    assert stop
    out = greedy(llm, "import os", max_tokens=12, ignore_eos=True, stop=[stop])
    assert out.finish_reason == "stop" and out.text == full.text[: full.text.find(stop)]


def test_max_model_len_stops_generation(checkpoint_factory):
    llm = LLM(model=str(checkpoint_factory("llama")), device="cpu", max_model_len=12)
    prompt = llm.tokenizer.encode("import os")
    out = llm.generate([prompt], SamplingParams(max_tokens=None, temperature=0, ignore_eos=True))[0].outputs[0]
    assert len(prompt) + len(out.token_ids) == 12 and out.finish_reason == "length"


def test_n_samples_are_independent_and_seed_reproducible(llm):
    params = SamplingParams(max_tokens=8, temperature=1.0, n=3, seed=1234, ignore_eos=True)
    a = llm.generate("def f(", params)[0]
    b = llm.generate("def f(", params)[0]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len({tuple(o.token_ids) for o in a.outputs}) > 1
    c = llm.generate("def f(", SamplingParams(max_tokens=8, temperature=1.0, n=3, seed=99, ignore_eos=True))[0]
    assert [o.token_ids for o in c.outputs] != [o.token_ids for o in a.outputs]


def test_logprobs_are_reported_for_each_token(llm):
    out = greedy(llm, "import os", max_tokens=4, ignore_eos=True, logprobs=3)
    assert len(out.logprobs) == 4
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == tok and len(lp.top) == 3
        # greedy picks the top token; both logprobs are the same element of one log-softmax row: bit-exact
        assert lp.top[0][0] == tok and lp.top[0][1] == lp.logprob
        assert lp.logprob <= 0


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"),
    (dict(top_k=-5), "top_k"), (dict(n=0), "n="), (dict(min_p=2), "min_p"),
])
def test_bad_sampling_params_are_rejected(kwargs, message):
    with pytest.raises(KestrelError, match=message):
        SamplingParams(**kwargs)


def test_bad_prompts_are_rejected_before_anything_runs(llm):
    with pytest.raises(KestrelError, match="empty"):
        llm.generate([[]], SamplingParams())
    with pytest.raises(KestrelError, match="out of range"):
        llm.generate([[10**7]], SamplingParams())
    with pytest.raises(KestrelError, match="maximum context length"):
        llm.generate([[1] * 300], SamplingParams())
    with pytest.raises(KestrelError, match="maximum context length"):
        llm.generate([[1, 2]], SamplingParams(max_tokens=1000))
    assert not llm.engine.has_unfinished()


def copy_model(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_unsupported_architecture_is_named(checkpoint_factory, tmp_path):
    d = copy_model(checkpoint_factory("llama"), tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel.*not supported"):
        LLM(model=str(d), device="cpu")


def test_missing_config_and_weights_are_named(checkpoint_factory, tmp_path):
    d = copy_model(checkpoint_factory("llama"), tmp_path / "m")
    (d / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        LLM(model=str(d), device="cpu")
    (d / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="config.json"):
        LLM(model=str(d), device="cpu")
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(model=str(tmp_path / "nowhere"), device="cpu")


def test_missing_shard_is_named(checkpoint_factory, tmp_path):
    d = copy_model(checkpoint_factory("llama", tie=True, shard=True), tmp_path / "m")
    shard = sorted(d.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ModelLoadError, match=shard.name):
        LLM(model=str(d), device="cpu")


def test_wrong_shape_and_missing_tensor_are_named(checkpoint_factory, tmp_path):
    d = copy_model(checkpoint_factory("llama"), tmp_path / "m")
    tensors = load_file(str(d / "model.safetensors"))
    name = "model.layers.0.mlp.up_proj.weight"
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="up_proj.weight.*shape"):
        LLM(model=str(d), device="cpu")
    del tensors[name]
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="lacks tensor.*gate_up_proj"):
        LLM(model=str(d), device="cpu")


def test_bad_engine_options_are_rejected():
    with pytest.raises(KestrelError, match="block-size"):
        LLM(block_size=3, device="cpu")
    with pytest.raises(KestrelError, match="unknown engine option"):
        LLM(not_an_option=1)


@pytest.mark.slow
def test_generate_cli_streams_text(checkpoint_factory):
    model = checkpoint_factory("llama")
    proc = subprocess.run([sys.executable, "-m", "kestrel.cli", "generate", "--model", str(model), "--device",
                           "cpu", "--prompt", "import os", "--max-tokens", "6"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("import os")
    assert "6 generated" in proc.stderr and "loading weights" in proc.stderr


@pytest.mark.slow
def test_generate_cli_reports_bad_model_without_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "kestrel.cli", "generate", "--model", str(tmp_path),
                           "--prompt", "x"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "config.json" in proc.stderr and "Traceback" not in proc.stderr


def test_activation_profile_batch_stays_within_the_models_positions(checkpoint_factory):
    """KV-cache sizing runs the largest step (max_num_batched_tokens prompt tokens) before the cache exists. As one
    sequence it put 8192 positions through the default model's 2048-row rotary table (an illegal memory access on
    the H200); it is now split into sequences of at most max_model_len, and a real forward accepts it."""
    from kestrel.config import EngineConfig
    from kestrel.forward.startup import activation_profile_batch, build_runner
    from kestrel.progress import Progress
    batch, blocks = activation_profile_batch(tokens=600, max_model_len=256, block_size=16)
    assert batch.query_start_loc.tolist() == [0, 256, 512, 600]
    assert batch.positions.max().item() == 255 and batch.positions.numel() == 600
    assert blocks == 16 + 16 + 6 and sorted(batch.slot_mapping.tolist()) == list(range(600))   # no slot shared
    setup = build_runner(EngineConfig(model=str(checkpoint_factory("llama")), device="cpu",
                                      max_model_len=256), Progress())   # the checkpoint has 256 positions
    setup.runner.allocate_kv_cache(blocks)
    out = setup.runner.forward(batch)
    assert out.logits.shape[0] == 3 and bool(out.logits.isfinite().all())
