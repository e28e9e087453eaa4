"""The decode-batch fast paths inside the engine on CUDA: skinny matmuls (layers/skinny.py, Triton for every
shape) and the overlap schedule give the same greedy tokens as the plain path (fp32 model: exact; bf16: the
share of identical tokens is reported, near-ties can flip)."""
from __future__ import annotations

import pytest
import torch

from tests.gpu.engine_tokens import greedy_tokens

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

def _tokens(path: str, monkeypatch, skinny: str, **kw) -> list[list[int]]:
    return greedy_tokens(path, monkeypatch, {"KESTREL_SKINNY_MATMUL": skinny}, **kw)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_skinny_and_overlap_match_plain_path_fp32(checkpoint_factory, monkeypatch, arch):
    path = str(checkpoint_factory(arch))
    plain = _tokens(path, monkeypatch, "0", dtype="float32", disable_overlap_schedule=True)
    assert _tokens(path, monkeypatch, "all", dtype="float32") == plain
    assert _tokens(path, monkeypatch, "auto", dtype="float32", disable_cuda_graph=True) == plain


def test_skinny_default_model_bf16(monkeypatch):
    plain = _tokens(None, monkeypatch, "0", disable_overlap_schedule=True)
    fast = _tokens(None, monkeypatch, "all")
    same = sum(a == b for p, f in zip(plain, fast) for a, b in zip(p, f)) / sum(len(p) for p in plain)
    print(f"default model bf16, skinny+overlap vs plain: {same:.3f} of tokens identical")
    # bf16 sums in another order flip near-ties, and a flip changes the rest of that sequence (H200: 0.79);
    # the exact check is the fp32 test above. Here: the paths agree at the start of every sequence.
    assert all(p[:2] == f[:2] for p, f in zip(plain, fast)) and same >= 0.5
