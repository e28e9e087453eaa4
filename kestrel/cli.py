"""`kestrel generate | serve | bench | launch | convert`: thin — parse, then hand over to the module that owns it."""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

from kestrel.errors import KestrelError

# subcommand -> module with `add_parser(subparsers)` and `run(args) -> int`
SUBCOMMANDS = {
    "generate": "kestrel.generate_cli",
    "serve": "kestrel.server.cli",
    "bench": "kestrel.bench.cli",
    "launch": "kestrel.bench.launch_cli",
    "convert": "kestrel.convert_cli",
}


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    parser = argparse.ArgumentParser(prog="kestrel", description="Kestrel LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    modules = {}
    for name, module_name in SUBCOMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if not exc.name or not exc.name.startswith("kestrel"):
                raise
            continue  # subcommand not built yet
        module.add_parser(sub)
        modules[name] = module
    args = parser.parse_args(argv)
    try:
        return int(modules[args.command].run(args) or 0)
    except KestrelError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
