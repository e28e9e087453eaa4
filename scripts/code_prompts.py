"""Code-completion prompts for the default model's drafter (kestrel-tiny completes Python): openings of the
Python standard library's modules as JSONL {"text": ...} prompts for `kestrel train-eagle3 --data`.

    python scripts/code_prompts.py --out train.jsonl --held-out held_out.jsonl

Training prompts come from the stdlib outside test/; held-out prompts from its test/ package (which
kestrel-tiny never saw either), so an evaluation never meets a file the drafter trained on.
"""
from __future__ import annotations

import argparse
import json
import random
import sysconfig
from pathlib import Path

SKIP_DIRS = {"__pycache__", "site-packages", "dist-packages", "idle_test", "test", "tests", "idlelib", "turtledemo"}


def windows(path: Path, lines_per_prompt: int, per_file: int, rng: random.Random) -> list[str]:
    """Up to per_file snippets of lines_per_prompt lines, the first at the top of the file."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (UnicodeDecodeError, OSError):
        return []
    if len(lines) < lines_per_prompt or max(map(len, lines)) > 400:   # no data blobs (base64, tables)
        return []
    starts = [0] + sorted(rng.sample(range(1, len(lines) - lines_per_prompt + 1),
                                     min(per_file - 1, len(lines) - lines_per_prompt)))
    return ["\n".join(lines[s:s + lines_per_prompt]) + "\n" for s in starts]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default=sysconfig.get_paths()["stdlib"], help="the stdlib directory (default: %(default)s)")
    ap.add_argument("--out", required=True, help="training prompts JSONL")
    ap.add_argument("--held-out", help="held-out prompts JSONL (from the stdlib's test/ package)")
    ap.add_argument("--per-file", type=int, default=4, help="snippets per module (default: %(default)s)")
    ap.add_argument("--lines", type=int, default=12, help="lines per snippet (default: %(default)s)")
    ap.add_argument("--held-out-count", type=int, default=64, help="held-out prompts (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    root, rng = Path(args.root), random.Random(args.seed)
    train = [p for p in sorted(root.rglob("*.py")) if not SKIP_DIRS & set(p.relative_to(root).parts[:-1])]
    prompts = [w for p in train for w in windows(p, args.lines, args.per_file, rng)]
    Path(args.out).write_text("".join(json.dumps({"text": t}) + "\n" for t in prompts))
    print(f"{len(prompts)} training prompts from {len(train)} modules -> {args.out}")
    if args.held_out:
        tests = sorted((root / "test").glob("test_*.py"))
        rng.shuffle(tests)
        held = [w for p in tests for w in windows(p, args.lines, 1, rng)][:args.held_out_count]
        Path(args.held_out).write_text("".join(json.dumps({"text": t}) + "\n" for t in held))
        print(f"{len(held)} held-out prompts from {root / 'test'} -> {args.held_out}")


if __name__ == "__main__":
    main()
