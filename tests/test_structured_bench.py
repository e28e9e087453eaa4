"""benchmarks/structured_bench.py: its byte-level vocabulary spells what JSON needs and xgrammar reads it as
byte-level; --smoke end to end on the CPU: both modes do the same token work, every output the grammar ended
validates against its schema, the ratio is the medians'."""
from __future__ import annotations

import json
import statistics

import pytest

from benchmarks import structured_bench
from kestrel.models.tokenizer import Tokenizer


def test_bytelevel_vocabulary_spells_every_byte_and_is_read_as_byte_level(tmp_path):
    import xgrammar as xgr

    from kestrel.structured.compiler import tokenizer_info

    structured_bench.write_bytelevel_tokenizer(tmp_path, 1024)
    tokenizer = Tokenizer(tmp_path)
    assert len(tokenizer.hf) == 1024
    first = len(structured_bench.SPECIALS)
    # ids first .. first + 255 are the bytes in order: each decodes to itself (ASCII ones as text)
    assert "".join(tokenizer.decode([first + b]) for b in range(32, 127)) == "".join(map(chr, range(32, 127)))
    text = '{"a": [1, 2], "b": "x y"}'
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    info = tokenizer_info(tokenizer.hf, 1024, [1])
    assert info.vocab_type == xgr.VocabType.BYTE_LEVEL
    assert info.decoded_vocab[first + ord('"')] == b'"'


@pytest.mark.slow
def test_smoke_run_reports_matched_work_and_valid_outputs(tmp_path):
    out = tmp_path / "structured.json"
    assert structured_bench.main(["--smoke", "--out", str(out), "--workdir", str(tmp_path)]) == 0
    r = json.loads(out.read_text())
    assert r["smoke"] and r["gpu"] is None and r["shape"] == "tiny"
    assert set(r["compile_s"]) == set(structured_bench.SCHEMAS) and all(t > 0 for t in r["compile_s"].values())
    for constrained, plain in zip(r["json_schema"], r["unconstrained"], strict=True):
        assert constrained["output_tokens"] == plain["output_tokens"]   # request i replayed at its length
        assert plain["finish_reasons"] == {"length": r["requests"]}
        assert sum(constrained["finish_reasons"].values()) == r["requests"]
        assert constrained["ended_by_grammar"] == constrained["finish_reasons"].get("stop", 0)
    assert sum(c["ended_by_grammar"] for c in r["json_schema"]) > 0, "no output was ended by its grammar"
    assert r["valid_fraction"] == 1.0
    medians = [statistics.median(x["output_tok_s"] for x in r[mode]) for mode in ("json_schema", "unconstrained")]
    assert r["json_over_plain"] == pytest.approx(medians[0] / medians[1])
