"""`--load-format dummy` (vLLM's name): random weights made on the device instead of read from a checkpoint.

For benchmarks of shapes whose checkpoint would not fit the disk or the time (Qwen3-30B-A3B is 61 GB in bf16): the
model directory needs only config.json and the tokenizer files. Every step costs what it would with real weights
(the same kernels read the same bytes); only the tokens are meaningless.

    matrices (linears, embeddings, stacked experts, the router)   normal, std 0.02 (HF's initializer_range)
    norm weights                                                  1
    biases, DeepSeek's e_score_correction_bias                    0 (the bias steers routing: 0 leaves it spread)

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


def init_dummy_weights(model: nn.Module, seed: int = 0, progress: Progress | None = None) -> None:
    """Fill every parameter of `model` in place, on its own device, with the values the module docstring lists."""
    params = list(model.named_parameters())   # tied weights once
    for name, p in params:
        if not (p.dtype.is_floating_point and p.dtype.itemsize >= 2):
            # FP8 weights and their scales: there is no random FP8 to draw that matches a quantized checkpoint
            raise KestrelError(f"--load-format dummy cannot fill {name} ({p.dtype}): FP8 models need a "
                               "checkpoint; drop --quantization or the checkpoint's quantization_config")
    total = sum(p.numel() * p.element_size() for _, p in params)
    if progress:
        progress.begin("loading_weights", total, "B")
    start, done = time.monotonic(), 0
    with torch.no_grad():
        for name, p in params:
            _fill(name, p.data, seed)
            done += p.numel() * p.element_size()
            if progress:
                progress.update(done)
    if params and params[0][1].is_cuda:
        torch.cuda.synchronize(params[0][1].device)
    logger.info("dummy weights: %.2f GB of random weights in %.1f s (no checkpoint read)", total / 1e9,
                time.monotonic() - start)


def _fill(name: str, t: torch.Tensor, seed: int) -> None:
    if t.dim() == 1:
        # a vector is a norm's scale or a bias; a norm's name says so in every supported model
        t.fill_(1.0 if "norm" in name else 0.0)
        return
    gen = torch.Generator(device=t.device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    t.normal_(0.0, WEIGHT_STD, generator=gen)
