"""`--load-format dummy` (vLLM's name): random weights made on the device instead of read from a checkpoint.

For benchmarks of shapes whose checkpoint would not fit the disk or the time (Qwen3-30B-A3B is 61 GB in bf16): the
model directory needs only config.json and the tokenizer files. Every step costs what it would with real weights
(the same kernels read the same bytes); only the tokens are meaningless.

    matrices (linears, embeddings, stacked experts, the router)   normal, std 0.02 (HF's initializer_range)
    norm weights                                                  1
    biases, DeepSeek's e_score_correction_bias                    0 (the bias steers routing: 0 leaves it spread)
    FP8 weights (a checkpoint's quantization_config, or           the same normal draw divided by FP8_SCALE and
      --quantization fp8)                                         cast to E4M3; every scale FP8_SCALE (so the
                                                                  weights a kernel sees are those of the bf16 draw,
                                                                  to FP8's rounding, and vLLM's dummy FP8 load of
                                                                  the same config reads the same bytes)

The router at std 0.02 over a normalised hidden state of width 2048 gives logits of std ~0.9: soft, token-dependent
routing that spreads tokens over the experts, as a trained router does on average.

Each parameter draws from a generator seeded by (seed, its name), so a tensor-parallel rank builds exactly the
replicated parameters every other rank builds (norms, the router); sharded ones are each rank's own random shard,
which is all a benchmark needs (the ranks do not together form one TP=1 model).
"""
from __future__ import annotations

import logging
import time
import zlib

import torch
from torch import nn

from kestrel.errors import KestrelError
from kestrel.progress import Progress

logger = logging.getLogger("kestrel.loader")

WEIGHT_STD = 0.02
FP8_SCALE = WEIGHT_STD * 4 / 448   # +-4 std onto E4M3's +-448


def init_dummy_weights(model: nn.Module, seed: int = 0, progress: Progress | None = None) -> None:
    """Fill every parameter of `model` in place, on its own device, with the values the module docstring lists."""
    params = list(model.named_parameters())   # tied weights once
    fp8_owners = {name.rpartition(".")[0] for name, p in params if p.dtype == torch.float8_e4m3fn}
    for name, p in params:
        if not p.dtype.is_floating_point or (p.dtype.itemsize < 2 and p.dtype != torch.float8_e4m3fn):
            raise KestrelError(f"--load-format dummy cannot fill {name} ({p.dtype}): a checkpoint is needed")
    total = sum(p.numel() * p.element_size() for _, p in params)
    if progress:
        progress.begin("loading_weights", total, "B")
    start, done = time.monotonic(), 0
    with torch.no_grad():
        for name, p in params:
            if _is_fp8_scale(name, fp8_owners):
                p.data.fill_(FP8_SCALE)
            else:
                _fill(name, p.data, seed)
            done += p.numel() * p.element_size()
            if progress:
                progress.update(done)
        for name, b in model.named_buffers():   # per-row FP8 layers keep their scales as buffers
            if _is_fp8_scale(name, fp8_owners):
                b.fill_(FP8_SCALE)
    if params and params[0][1].is_cuda:
        torch.cuda.synchronize(params[0][1].device)
    logger.info("dummy weights: %.2f GB of random weights in %.1f s (no checkpoint read)", total / 1e9,
                time.monotonic() - start)


def _is_fp8_scale(name: str, fp8_owners: set[str]) -> bool:
    owner, _, leaf = name.rpartition(".")
    return owner in fp8_owners and "scale" in leaf


def _fill(name: str, t: torch.Tensor, seed: int) -> None:
    if t.dim() == 1:
        # a vector is a norm's scale or a bias; a norm's name says so in every supported model
        t.fill_(1.0 if "norm" in name else 0.0)
        return
    gen = torch.Generator(device=t.device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    if t.dtype != torch.float8_e4m3fn:
        t.normal_(0.0, WEIGHT_STD, generator=gen)
        return
    rows = max(1, (64 << 20) // max(1, t[0].numel() * 4))   # drawn in float32 slabs of <= 64 MiB
    for i in range(0, t.shape[0], rows):
        slab = torch.empty(t[i:i + rows].shape, dtype=torch.float32, device=t.device).normal_(0.0, WEIGHT_STD,
                                                                                              generator=gen)
        t[i:i + rows] = (slab / FP8_SCALE).clamp(-448, 448).to(torch.float8_e4m3fn)
