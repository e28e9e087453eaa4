"""`kestrel generate | serve | bench | launch | convert | quantize`: thin — parse, then hand over to its module."""
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
    "quantize": "kestrel.quantize_cli",
    "train-eagle3": "kestrel.train.train_cli",
    "eval-drafter": "kestrel.train.eval_cli",
}


class HelpFormatter(argparse.HelpFormatter):
    """vLLM-style help: each option's default appended once as "(default: X)".

    Not shown where the help already names a default (a derived one: "default: the model's"), where it is None
    (nothing set: the help says what happens) or for on/off flags (off unless given)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        # `is`, not `in`: a default of 0 equals False
        if "default" in help_text or action.default is None or action.default is False \
                or action.default == argparse.SUPPRESS \
                or isinstance(action, (argparse._StoreTrueAction, argparse._HelpAction, argparse._VersionAction)) \
                or not action.option_strings:
            return help_text
        return f"{help_text} (default: %(default)s)"


def build_parser() -> tuple[argparse.ArgumentParser, dict]:
    """The whole command line: the top parser and {subcommand: its module} (those whose module imports)."""
    parser = argparse.ArgumentParser(prog="kestrel", description="Kestrel LLM inference engine",
                                     formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
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
    for subparser in sub.choices.values():
        if subparser.formatter_class is argparse.HelpFormatter:   # a subcommand that chose its own keeps it
            subparser.formatter_class = HelpFormatter
    return parser, modules


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    # Kestrel's INFO lines are its progress; torch's (e.g. its exit-time cache statistics, once the server's
    # tokenizer thread has imported transformers and so torch) are not for users
    logging.getLogger("torch").setLevel(logging.WARNING)
    # nor is a line per HTTP request huggingface_hub makes for a Hub id (its progress is models/hub.py's lines)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    parser, modules = build_parser()
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
