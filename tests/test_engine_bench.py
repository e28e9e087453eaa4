"""benchmarks/engine_bench.py's CPU-checkable parts: the bytes one decode step reads (the roofline's numerator)
and the single-stream measurement on a real tiny engine."""
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


def test_single_stream_counts_every_token_and_times_decode_apart_from_the_first(checkpoint_factory):
    engine = Engine(EngineConfig(model=str(checkpoint_factory("llama")), device="cpu"))
    r = single_stream(engine, [[5, 6, 7, 8], [9, 10, 11]], max_tokens=6)
    assert r["tok_s"] > 0 and r["decode_tok_s"] > 0 and r["ttft_ms_mean"] > 0
    assert abs(r["ms_per_token"] - 1000 / r["tok_s"]) < 1e-6


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
