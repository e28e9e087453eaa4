"""The roofline's byte count: what one decode step reads, on real tiny checkpoints loaded by Kestrel's loader."""
import pytest

from benchmarks.roofline import decode_weight_bytes
from kestrel.models.loader import load_weights
from kestrel.models.model_config import load_model_config
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
