#!/usr/bin/env bash
# The default model's EAGLE-3 drafter (models/kestrel-tiny-eagle3), trained on the CPU by `kestrel train-eagle3`:
# the recipe, rerunnable. kestrel-tiny completes Python, so its prompts are 12-line openings and windows of the
# Python standard library outside test/ (scripts/code_prompts.py); the held-out prompts come from test/.
#
#   bash scripts/train_tiny_drafter.sh [OUT_DIR]      (default /tmp/kestrel-tiny-eagle3; ~1 h on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${1:-/tmp/kestrel-tiny-eagle3}
mkdir -p "$OUT"
$PY scripts/code_prompts.py --out "$OUT/train_prompts.jsonl" --held-out "$OUT/held_out_prompts.jsonl" --per-file 1
$PY -m kestrel.cli train-eagle3 --output "$OUT" --data "$OUT/train_prompts.jsonl" --max-new-tokens 128 \
  --max-len 512 --draft-vocab-size 2048 --epochs 6 --batch-size 8 --ttt-steps 5 --lr 5e-4 --checkpoint-every 100 \
  --device cpu --eval-data "$OUT/held_out_prompts.jsonl" --eval-prompts 64 --eval-max-new-tokens 128
