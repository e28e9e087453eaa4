"""`kestrel convert MODEL.gguf OUT_DIR`: write a GGUF checkpoint as an HF-format safetensors directory."""
from __future__ import annotations

import argparse
from pathlib import Path

from kestrel.config import add_hub_args, hub_options
from kestrel.errors import KestrelError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("convert", help="GGUF file (or smollm2) -> HF-format safetensors directory")
    p.add_argument("source", help=".gguf file, a short name such as smollm2, or one file of a Hub repo: "
                   "ORG/NAME/FILE.gguf")
    p.add_argument("out_dir", help="directory to write (new or empty)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="dtype of the written weights")
    add_hub_args(p)


def run(args: argparse.Namespace) -> int:
    from kestrel.models.gguf import is_gguf
    from kestrel.models.gguf.convert import convert
    from kestrel.models.names import resolve_model

    source = resolve_model(args.source, hub_options(args), fetch=True)
    if not is_gguf(source):
        raise KestrelError(f"kestrel convert reads .gguf files; {args.source!r} is not one")
    out = convert(source, Path(args.out_dir), args.dtype)
    print(out)
    return 0
