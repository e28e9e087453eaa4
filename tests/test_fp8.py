"""FP8 checkpoints load as FP8 and compute what their dequantized weights compute.

Each format is written at test time from the default model (kestrel-tiny, bf16) by kestrel/models/fp8_writer.py,
with the real tensor names and dtypes. The reference is independent of Kestrel's FP8 code: the test reads the
written files itself, multiplies W = w8 * scale in plain torch (scales expanded by indexing), writes a float32
checkpoint without quantization_config and runs HF transformers on it. On the CPU Kestrel's FP8 method
dequantizes exactly (float32), so prompt logits agree to 1e-4 and greedy tokens are identical."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from kestrel import LLM, SamplingParams
from kestrel.config import DEFAULT_MODEL_DIR, EngineConfig
from kestrel.distributed.comm import TPGroup
from kestrel.errors import KestrelError, ModelLoadError
from kestrel.layers.fp8 import Fp8LinearMethod, Fp8Scheme
from kestrel.kernels.fp8_quant import FP8, dequantize, quantize_per_block, quantize_per_row, quantize_per_tensor
from kestrel.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from kestrel.models.fp8_writer import write_fp8_checkpoint
from kestrel.models.quantization import fp8_scheme
from tests.tolerances import assert_close_scaled

PROMPTS = ["def add(a, b):\n    return a + b\n", "import os", "class Stack:\n    def __init__(self):\n"]
MAX_TOKENS = 12
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
LOGIT_TOL = 1e-4   # of the largest logit (if above 1); float32 both sides, same weights: only summation order differs
IGNORED = ("model.layers.1.mlp.down_proj",)

# (format, strategy, block, modules left float)
FORMATS = {
    "hf-block128": ("hf", "block", (128, 128), IGNORED),
    "hf-tensor": ("hf", "tensor", (128, 128), ()),
    "ct-channel": ("compressed-tensors", "channel", (128, 128), IGNORED),
    "ct-tensor": ("compressed-tensors", "tensor", (128, 128), ()),
    "ct-block64x128": ("compressed-tensors", "block", (64, 128), ()),
}


# -- the independent reference ----------------------------------------------------------------------------------

def plain_dequantize(w8: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    w = w8.to(torch.float32)
    if scale.numel() == 1:
        return w * scale.reshape(()).float()
    if scale.shape == (w.shape[0], 1):
        return w * scale.float()
    rows = torch.arange(w.shape[0]) // block[0]
    cols = torch.arange(w.shape[1]) // block[1]
    return w * scale.float()[rows][:, cols]


def float_reference(fp8_dir: Path, out: Path) -> Path:
    """fp8_dir's weights dequantized (W = w8 * s) into a float32 checkpoint HF transformers loads."""
    config = json.loads((fp8_dir / "config.json").read_text())
    quant = config.pop("quantization_config")
    block = quant.get("weight_block_size") or next(iter(quant.get("config_groups", {"g": {}}).values())).get(
        "weights", {}).get("block_structure")
    config["dtype"] = "float32"
    tensors = {}
    with safe_open(str(fp8_dir / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        for name in names:
            if name.endswith(("weight_scale", "weight_scale_inv")):
                continue
            t = f.get_tensor(name)
            if t.dtype == torch.float8_e4m3fn:
                stem = name.removesuffix("weight")
                scale_name = next(stem + s for s in ("weight_scale_inv", "weight_scale") if stem + s in names)
                t = plain_dequantize(t, f.get_tensor(scale_name), block)
            tensors[name] = t.float().contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config))
    return out


def online_reference(out: Path, per_tensor: bool) -> Path:
    """The default model's projections quantized the --quantization way (per row or per tensor, amax / 448),
    dequantized back, as a float32 checkpoint."""
    config = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
    config["dtype"] = "float32"
    tensors = {}
    with safe_open(str(DEFAULT_MODEL_DIR / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            t = f.get_tensor(name).float()
            if name.startswith("model.layers.") and name.endswith("_proj.weight"):
                amax = t.abs().amax() if per_tensor else t.abs().amax(dim=1, keepdim=True)
                scale = amax / 448.0
                t = (t / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale
            tensors[name] = t.contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config))
    return out


def hf_logits_and_greedy(ref_dir: Path, prompt_ids: list[list[int]]) -> tuple[list[torch.Tensor], list[list[int]]]:
    hf = AutoModelForCausalLM.from_pretrained(str(ref_dir), dtype=torch.float32)
    logits, tokens = [], []
    with torch.no_grad():
        for ids in prompt_ids:
            x = torch.tensor([ids])
            logits.append(hf(x).logits[0])
            g = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_TOKENS, do_sample=False,
                            eos_token_id=None, pad_token_id=0)
            tokens.append(g[0, len(ids):].tolist())
    return logits, tokens


def assert_matches_reference(llm: LLM, ref_dir: Path) -> None:
    results = llm.generate(PROMPTS, GREEDY)
    prompt_ids = [r.prompt_token_ids for r in results]
    ref_logits, ref_tokens = hf_logits_and_greedy(ref_dir, prompt_ids)
    for ids, want in zip(prompt_ids, ref_logits):
        got = llm.engine.prompt_logits(ids)
        assert got.shape == want.shape
        assert_close_scaled(got, want, LOGIT_TOL, "prompt logits")
    assert [r.outputs[0].token_ids for r in results] == ref_tokens


@pytest.fixture(scope="module")
def fp8_checkpoints(tmp_path_factory):
    cache: dict[str, Path] = {}

    def make(key: str) -> Path:
        if key not in cache:
            fmt, strategy, block, ignore = FORMATS[key]
            cache[key] = write_fp8_checkpoint(DEFAULT_MODEL_DIR, tmp_path_factory.mktemp(key), fmt, strategy,
                                              block, ignore)
        return cache[key]

    return make


# -- the formats --------------------------------------------------------------------------------------------------

def test_writer_uses_the_formats_names_dtypes_and_shapes(fp8_checkpoints):
    hf = fp8_checkpoints("hf-block128")
    with safe_open(str(hf / "model.safetensors"), framework="pt") as f:
        q = f.get_slice("model.layers.0.self_attn.q_proj.weight")
        s = f.get_slice("model.layers.0.self_attn.q_proj.weight_scale_inv")
        assert (q.get_dtype(), q.get_shape()) == ("F8_E4M3", [256, 256])
        assert (s.get_dtype(), s.get_shape()) == ("F32", [2, 2])
        up = f.get_slice("model.layers.0.mlp.up_proj.weight_scale_inv")
        assert up.get_shape() == [6, 2]   # [ceil(768 / 128), ceil(256 / 128)]
        assert f.get_slice("model.layers.1.mlp.down_proj.weight").get_dtype() == "BF16"   # ignored
        assert "model.layers.1.mlp.down_proj.weight_scale_inv" not in f.keys()
        assert f.get_slice("model.embed_tokens.weight").get_dtype() == "BF16"
    quant = json.loads((hf / "config.json").read_text())["quantization_config"]
    assert quant == {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                     "weight_block_size": [128, 128], "modules_to_not_convert": list(IGNORED)}
    ct = fp8_checkpoints("ct-channel")
    with safe_open(str(ct / "model.safetensors"), framework="pt") as f:
        s = f.get_slice("model.layers.0.mlp.gate_proj.weight_scale")
        assert (s.get_dtype(), s.get_shape()) == ("F32", [768, 1])
    quant = json.loads((ct / "config.json").read_text())["quantization_config"]
    assert quant["format"] == "float-quantized" and quant["ignore"] == ["lm_head", *IGNORED]
    assert quant["config_groups"]["group_0"]["weights"]["strategy"] == "channel"
    with safe_open(str(fp8_checkpoints("ct-tensor") / "model.safetensors"), framework="pt") as f:
        assert f.get_slice("model.layers.0.self_attn.o_proj.weight_scale").get_shape() == [1]


@pytest.mark.slow
@pytest.mark.parametrize("key", list(FORMATS))
def test_fp8_checkpoint_matches_its_dequantized_weights_in_hf(fp8_checkpoints, tmp_path, key):
    path = fp8_checkpoints(key)
    llm = LLM(model=str(path), device="cpu")
    try:
        model = llm.engine.runner.model
        qkv = model.layers[0].self_attn.qkv_proj
        assert qkv.weight.dtype == FP8                                      # kept FP8 in memory
        down = model.layers[1].mlp.down_proj
        assert down.weight.dtype == (torch.float32 if FORMATS[key][3] else FP8)   # the ignore list
        assert_matches_reference(llm, float_reference(path, tmp_path / "ref"))
    finally:
        llm.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("flag", ["fp8", "fp8-per-tensor"])
def test_quantization_flag_on_the_default_model_matches_plain_torch_quantization(tmp_path, flag):
    llm = LLM(device="cpu", quantization=flag)
    try:
        gate_up = llm.engine.runner.model.layers[0].mlp.gate_up_proj
        assert gate_up.weight.dtype == FP8 and gate_up.weight_scale.shape == (1536, 1)
        if flag == "fp8-per-tensor":   # gate and up keep a scale each (per row: two values)
            assert gate_up.weight_scale.unique().numel() == 2
        assert_matches_reference(llm, online_reference(tmp_path / "ref", flag == "fp8-per-tensor"))
    finally:
        llm.shutdown()


def test_loading_reports_fp8_bytes(fp8_checkpoints):
    """The loader's progress counts the bytes of the FP8 files (about half the bf16 model's projections)."""
    from kestrel.progress import Progress

    seen = []

    class Recording(Progress):
        def begin(self, phase, total=None, unit=None):
            seen.append((phase, total, unit))
            super().begin(phase, total, unit)

    path = fp8_checkpoints("ct-tensor")
    from kestrel.forward.startup import build_runner

    build_runner(EngineConfig(model=str(path), device="cpu"), Recording())
    (total,) = [t for phase, t, unit in seen if phase == "loading_weights"]
    assert total == (path / "model.safetensors").stat().st_size
    assert total < (DEFAULT_MODEL_DIR / "model.safetensors").stat().st_size


# -- tensor parallelism -------------------------------------------------------------------------------------------

def _full_weights(out: int, inp: int, seed: int) -> torch.Tensor:
    return torch.randn(out, inp, generator=torch.Generator().manual_seed(seed)) * 0.05


def _quantize(w: torch.Tensor, kind: str):
    if kind == "row":
        return (*quantize_per_row(w), None)
    if kind == "tensor":
        return (*quantize_per_tensor(w), None)
    return (*quantize_per_block(w, (32, 32)), (32, 32))


def _layer(cls, tp: TPGroup, scheme: Fp8Scheme):
    method = Fp8LinearMethod(scheme)
    if cls is QKVParallelLinear:   # 4 heads of 32, 2 KV heads: q 128 rows, k 64, v 64
        return QKVParallelLinear(64, 32, 4, 2, tp=tp, method=method)
    if cls is MergedColumnParallelLinear:
        return MergedColumnParallelLinear(64, [128, 128], tp=tp, method=method)
    return RowParallelLinear(128, 64, tp=tp, method=method)


SHARDS = {QKVParallelLinear: [("q", 128), ("k", 64), ("v", 64)], MergedColumnParallelLinear: [(0, 128), (1, 128)],
          RowParallelLinear: [(None, 64)]}


@pytest.mark.parametrize("kind", ["row", "tensor", "block"])
@pytest.mark.parametrize("cls", list(SHARDS), ids=lambda c: c.__name__)
def test_scales_shard_with_their_weights(cls, kind):
    """Each rank's dequantized weight is its slice of the dequantized checkpoint tensors, for every layout."""
    block = (32, 32) if kind == "block" else None
    scheme = Fp8Scheme(method="test", block=block)
    in_features = 128 if cls is RowParallelLinear else 64
    checkpoint = []
    for i, (shard_id, rows) in enumerate(SHARDS[cls]):
        w8, scale, _ = _quantize(_full_weights(rows, in_features, seed=i), kind)
        checkpoint.append((shard_id, w8, scale, dequantize(w8, scale, block)))
    for rank in (0, 1):
        layer = _layer(cls, TPGroup(rank=rank, size=2), scheme)
        for shard_id, w8, scale, _ in checkpoint:
            kw = {} if shard_id is None else {"shard_id": shard_id}
            layer.weight.weight_loader(layer.weight, w8, "w", **kw)
            layer.weight_scale.weight_loader(layer.weight_scale, scale, "s", **kw)
        got = dequantize(layer.weight, layer.weight_scale, block)
        if cls is RowParallelLinear:
            want = checkpoint[0][3][:, rank * 64:(rank + 1) * 64]
        else:
            want = torch.cat([full.chunk(2)[rank] for _, _, _, full in checkpoint])
        assert torch.equal(got, want)


def test_block_scales_that_split_a_tile_are_refused():
    """A row-parallel split of 200 input columns over 2 ranks starts rank 1 at column 100, inside a 128-wide
    tile: refused, naming the tensor and the rank count that would do (1)."""
    layer = RowParallelLinear(200, 64, tp=TPGroup(rank=1, size=2),
                              method=Fp8LinearMethod(Fp8Scheme(method="fp8", block=(128, 128),
                                                               scale_name="weight_scale_inv")))
    w8, scale = quantize_per_block(_full_weights(64, 200, seed=0), (128, 128))
    with pytest.raises(ModelLoadError, match=r"tensor down_proj.weight_scale_inv: FP8 block scales of \[128, 128\] "
                       r"do not line up .*input columns 100..200 of 200.* over 2 ranks .* over 1 rank "):
        layer.weight_scale_inv.weight_loader(layer.weight_scale_inv, scale, "down_proj.weight_scale_inv")


# (layer, its checkpoint tensors (shard id, rows), in_features, TP size): parts that are not multiples of the
# 128-row tile (SmolLM2's q is 576 rows), a last partial tile along the input, and rank rows starting mid-tile
PARTIAL = {
    "qkv-9-3-heads": (lambda tp, m: QKVParallelLinear(320, 32, 9, 3, tp=tp, method=m),
                      [("q", 288), ("k", 96), ("v", 96)], 320, 1),
    "gate-up-200": (lambda tp, m: MergedColumnParallelLinear(320, [200, 200], tp=tp, method=m),
                    [(0, 200), (1, 200)], 320, 1),
    "down-200": (lambda tp, m: RowParallelLinear(200, 320, tp=tp, method=m), [(None, 320)], 200, 1),
    "qkv-tp2-mid-tile": (lambda tp, m: QKVParallelLinear(320, 32, 6, 2, tp=tp, method=m),
                         [("q", 192), ("k", 64), ("v", 64)], 320, 2),
}


@pytest.mark.parametrize("key", list(PARTIAL))
def test_block_scales_with_partial_tiles_load_and_compute(key):
    """HF block scales are ceil-sized: a tensor's last tile may be short. Each rank's dequantized weight is its
    rows of the dequantized checkpoint tensors, and the layer's matmul is x @ that.T."""
    build, shards, in_features, tp = PARTIAL[key]
    block = (128, 128)
    checkpoint = []
    for i, (shard_id, rows) in enumerate(shards):
        w8, scale = quantize_per_block(_full_weights(rows, in_features, seed=i), block)
        assert scale.shape == (-(-rows // 128), -(-in_features // 128))
        checkpoint.append((shard_id, w8, scale, plain_dequantize(w8, scale, block)))
    x = torch.randn(3, in_features, generator=torch.Generator().manual_seed(7))
    for rank in range(tp):
        method = Fp8LinearMethod(Fp8Scheme(method="fp8", block=block, scale_name="weight_scale_inv"))
        layer = build(TPGroup(rank=rank, size=tp), method)
        for shard_id, w8, scale, _ in checkpoint:
            kw = {} if shard_id is None else {"shard_id": shard_id}
            layer.weight.weight_loader(layer.weight, w8, "w", **kw)
            layer.weight_scale_inv.weight_loader(layer.weight_scale_inv, scale, "s", **kw)
        got = dequantize(layer.weight, layer.weight_scale_inv, method.block(layer))
        want = torch.cat([full.chunk(tp)[rank] for _, _, _, full in checkpoint])
        assert torch.equal(got, want)
        out = method.apply(layer, x)
        assert_close_scaled(out, x @ want.T, 1e-5, "partial-tile FP8 matmul")


@pytest.mark.slow
@pytest.mark.parametrize("source", ["hf-block64", "online-per-tensor"])
def test_fp8_model_at_tp2_equals_one_rank(tmp_path, source):
    """Block scales cut with their weights (64 x 64 tiles: kestrel-tiny's per-rank KV rows are 64), and online
    per-tensor scales, which every rank computes from the whole checkpoint tensor."""
    if source == "hf-block64":
        kw = dict(model=str(write_fp8_checkpoint(DEFAULT_MODEL_DIR, tmp_path / "fp8", "hf", "block", (64, 64))))
    else:
        kw = dict(quantization="fp8-per-tensor")
    assert_tp2_matches_one_rank(kw)


def assert_tp2_matches_one_rank(kw: dict) -> None:
    """LLM(**kw) at TP=2 (gloo) against one rank: prompt logits within LOGIT_TOL (float32; the split sums of
    o_proj / down_proj add in another order, seen up to ~1e-5 on these logits) and the same greedy tokens."""
    runs = []
    for tp in (1, 2):
        llm = LLM(device="cpu", tensor_parallel_size=tp, **kw)
        try:
            logits = [llm.engine.prompt_logits(llm.tokenizer.encode(p)) for p in PROMPTS]
            runs.append((logits, [r.outputs[0].token_ids for r in llm.generate(PROMPTS, GREEDY)]))
        finally:
            llm.shutdown()
    (ref_logits, ref_tokens), (logits, tokens) = runs
    for a, b in zip(ref_logits, logits):
        assert_close_scaled(b, a, LOGIT_TOL, "TP logits")
    assert tokens == ref_tokens


# -- errors -------------------------------------------------------------------------------------------------------

UNSUPPORTED = [
    ({"quant_method": "awq", "bits": 4}, "'awq'"),
    ({"quant_method": "gptq", "bits": 4}, "'gptq'"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, "'modelopt' \\(NVFP4\\)"),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "config_groups": {"g": {
        "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group"}}}},
     "'compressed-tensors' nvfp4-pack-quantized \\(float4"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {"g": {
        "weights": {"num_bits": 8, "type": "int", "strategy": "channel"}}}},
     "'compressed-tensors' int-quantized \\(int8"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "'fp8' with fmt 'e5m2'"),
]


@pytest.mark.parametrize("config,named", UNSUPPORTED, ids=[c["quant_method"] + str(i)
                                                          for i, (c, _) in enumerate(UNSUPPORTED)])
def test_unsupported_quantization_names_the_method(config, named):
    with pytest.raises(ModelLoadError, match=f"quantization {named}.* is not supported; Kestrel loads: fp8"):
        fp8_scheme(config, None, Path("ckpt"))


def test_unsupported_checkpoint_fails_at_startup_with_the_method_name(tmp_path):
    model = tmp_path / "awq"
    shutil.copytree(DEFAULT_MODEL_DIR, model)
    config = json.loads((model / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128}
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="quantization 'awq' is not supported"):
        LLM(model=str(model), device="cpu")


def test_unknown_quantization_flag_is_refused():
    with pytest.raises(KestrelError, match="--quantization 'int4' is invalid: expected fp8 or fp8-per-tensor"):
        EngineConfig(quantization="int4")


def test_quantize_cli_writes_a_checkpoint(tmp_path, capsys):
    from kestrel.cli import main

    out = tmp_path / "ct"
    assert main(["quantize", str(DEFAULT_MODEL_DIR), str(out), "--format", "compressed-tensors", "--strategy",
                 "block", "--block", "64", "64"]) == 0
    scheme = fp8_scheme(json.loads((out / "config.json").read_text())["quantization_config"], None, out)
    assert scheme == Fp8Scheme(method="compressed-tensors", block=(64, 64), scale_name="weight_scale",
                               ignore=("lm_head",))
    assert main(["quantize", str(DEFAULT_MODEL_DIR), str(out)]) == 2   # never overwrites


def test_ignore_entries_match_names_prefixes_suffixes_and_regexes():
    scheme = Fp8Scheme(method="t", ignore=("lm_head", "model.layers.0.mlp", "re:.*layers\\.3\\..*_proj$"))
    assert scheme.ignores("lm_head") and scheme.ignores("model.layers.0.mlp.down_proj")
    assert scheme.ignores("model.layers.3.self_attn.o_proj")
    assert not scheme.ignores("model.layers.10.mlp.down_proj") and not scheme.ignores("model.layers.1.mlp.up_proj")


def test_a_merged_layer_half_ignored_is_refused(tmp_path):
    path = write_fp8_checkpoint(DEFAULT_MODEL_DIR, tmp_path / "q-only", "hf", "block", (128, 128),
                                ("model.layers.0.self_attn.q_proj",))
    with pytest.raises(ModelLoadError, match=r"leaves model.layers.0.self_attn.q_proj unquantized but not "
                                             r"model.layers.0.self_attn.k_proj, model.layers.0.self_attn.v_proj"):
        LLM(model=str(path), device="cpu")


def test_a_float_tensor_where_fp8_is_expected_is_refused(tmp_path):
    path = write_fp8_checkpoint(DEFAULT_MODEL_DIR, tmp_path / "ct", "compressed-tensors", "channel")
    config = json.loads((path / "config.json").read_text())
    # the writer left down_proj of layer 1 FP8; pretend the checkpoint's ignore list was lost for a float module
    tensors = {}
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            tensors[name] = f.get_tensor(name)
    tensors["model.layers.1.mlp.down_proj.weight"] = tensors["model.layers.1.mlp.down_proj.weight"].to(torch.bfloat16)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"model.layers.1.mlp.down_proj.weight: the compressed-tensors "
                                             r"checkpoint's weight is torch.bfloat16, expected float8_e4m3fn"):
        LLM(model=str(path), device="cpu")


def test_static_activation_and_kv_cache_scales_are_not_read():
    """Kestrel quantizes activations per token and keeps its KV cache in the model dtype."""
    from torch import nn

    from kestrel.models.weight_placer import WeightPlacer

    placer = WeightPlacer(nn.Module())
    for name in ("model.layers.0.self_attn.q_proj.input_scale", "model.layers.0.self_attn.k_scale",
                 "model.layers.0.self_attn.v_scale"):
        assert placer.skips(name)
    assert not placer.skips("model.layers.0.self_attn.q_proj.weight_scale")


# -- `kestrel quantize` output loads, on the shapes that break tiles ---------------------------------------------

# hidden 288 and intermediate 200 (not multiples of 128), 9 heads of 32 and 3 KV heads (q 288 rows, k/v 96;
# HF wants hidden = heads x head_dim), the shape of SmolLM2-135M (576, 9 / 3 heads of 64) at half the size
RAGGED = dict(hidden_size=288, intermediate_size=200, num_heads=9, num_kv_heads=3, head_dim=32)
QUANTIZE_ARGS = {
    "default": [],   # hf, 128 x 128 blocks
    "hf-tensor": ["--strategy", "tensor"],
    "ct-channel": ["--format", "compressed-tensors"],
    "ct-tensor": ["--format", "compressed-tensors", "--strategy", "tensor"],
    "ct-block": ["--format", "compressed-tensors", "--strategy", "block"],
}


@pytest.mark.parametrize("key", list(QUANTIZE_ARGS))
def test_every_format_kestrel_quantize_writes_loads_with_ragged_shapes(checkpoint_factory, tmp_path, key):
    """`kestrel quantize` on a model whose rows and columns are not multiples of the 128 tile loads at TP=1 and
    matches its own dequantized weights run by HF transformers (prompt logits within LOGIT_TOL of the largest,
    greedy tokens equal)."""
    from kestrel.cli import main

    src = checkpoint_factory(**RAGGED)
    out = tmp_path / "fp8"
    assert main(["quantize", str(src), str(out), *QUANTIZE_ARGS[key]]) == 0
    llm = LLM(model=str(out), device="cpu")
    try:
        assert_matches_reference(llm, float_reference(out, tmp_path / "ref"))
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_a_tp_split_that_cuts_a_tile_is_refused_naming_the_tensor_and_rank_counts(checkpoint_factory, tmp_path):
    """Intermediate 200 over 2 ranks starts rank 1's down_proj columns at 100, inside a 128-wide tile: refused at
    load with the tensor and the rank count that would do. (The column-parallel rows split mid-tile load: each
    row keeps its tile's scale.)"""
    from kestrel.cli import main

    src = checkpoint_factory(hidden_size=192, intermediate_size=200, num_heads=6, num_kv_heads=2, head_dim=32)
    out = tmp_path / "fp8"
    assert main(["quantize", str(src), str(out)]) == 0
    with pytest.raises(KestrelError, match=r"down_proj\.weight_scale_inv: FP8 block scales of \[128, 128\] do not "
                       r"line up .* over 2 ranks cuts a 128-wide tile; this tensor splits on tile boundaries over "
                       r"1 rank "):
        LLM(model=str(out), device="cpu", tensor_parallel_size=2)


def _gguf_file(tmp_path: Path) -> Path:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF")
    return path


@pytest.mark.parametrize("source", ["missing", "smollm2", "gguf", "no-config"])
def test_quantize_of_what_is_not_an_hf_directory_is_one_error_line(tmp_path, capsys, source):
    from kestrel.cli import main

    src = {"missing": lambda: tmp_path / "nope", "smollm2": lambda: Path("smollm2"),
           "gguf": lambda: _gguf_file(tmp_path), "no-config": lambda: tmp_path}[source]()
    out = tmp_path / "out"
    assert main(["quantize", str(src), str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "Traceback" not in err[0], err
    if source in ("smollm2", "gguf"):
        assert "kestrel convert" in err[0]
    assert not out.exists()


def test_quantize_writes_its_own_model_card(checkpoint_factory, tmp_path):
    """The source's README.md (its model card) is not copied as if it described the FP8 checkpoint."""
    from kestrel.cli import main

    src = tmp_path / "src"
    shutil.copytree(checkpoint_factory(), src)
    (src / "README.md").write_text("# The source model\n\nTrained on things.\n")
    out = tmp_path / "fp8"
    assert main(["quantize", str(src), str(out)]) == 0
    card = (out / "README.md").read_text()
    assert card != (src / "README.md").read_text()
    assert "FP8" in card and "quantization of" in card and "128x128" in card and str(src) in card
