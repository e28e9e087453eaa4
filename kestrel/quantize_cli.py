"""`kestrel quantize SRC DST`: a float HF checkpoint written as an FP8 one (models/fp8_writer.py)."""
from __future__ import annotations

import argparse
from pathlib import Path

from kestrel.config import add_hub_args, hub_options


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("quantize", help="float HF checkpoint directory -> FP8 checkpoint (hf fp8 or "
                       "compressed-tensors)")
    p.add_argument("source", help="float HF checkpoint directory or Hub id, ORG/NAME (a GGUF file or a short name: "
                   "kestrel convert it first)")
    p.add_argument("out_dir", help="directory to write (new or empty)")
    p.add_argument("--format", dest="fmt", default="hf", choices=["hf", "compressed-tensors"],
                   help="hf: quant_method fp8 (DeepSeek-V3 / Qwen3-FP8 style); compressed-tensors: "
                   "float-quantized (llm-compressor style)")
    p.add_argument("--strategy", default=None, choices=["block", "channel", "tensor"],
                   help="scales per tile, output channel or tensor (default: block for hf, channel for "
                   "compressed-tensors)")
    p.add_argument("--block", type=int, nargs=2, default=[128, 128], metavar=("BN", "BK"),
                   help="the tile of block scales")
    p.add_argument("--ignore", nargs="*", default=[], metavar="MODULE",
                   help="checkpoint modules left float, e.g. model.layers.0.mlp.down_proj")
    p.add_argument("--device", default=None,
                   help="where the scales are computed (default: cuda when there is a GPU, else cpu)")
    add_hub_args(p)


def run(args: argparse.Namespace) -> int:
    import torch

    from kestrel.models.fp8_writer import write_fp8_checkpoint
    from kestrel.models.names import is_hub_name, resolve_model

    # a Hub id: its snapshot in the HF cache, fetched first
    source = resolve_model(args.source, hub_options(args), fetch=True) if is_hub_name(args.source) else args.source
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    out = write_fp8_checkpoint(Path(source), Path(args.out_dir), args.fmt, args.strategy, tuple(args.block),
                               tuple(args.ignore), device)
    print(out)
    return 0
