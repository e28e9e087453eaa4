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
