#!/usr/bin/env bash
# Issue #35 (MoE + MLA) on one GPU in one device call, about 400 s: tests/gpu/test_moe_gpu.py (the fused Triton MoE
# against the torch experts, CUDA graphs, MLA decode, engine tokens), then benchmarks/moe_bench.py on the
# Qwen3-30B-A3B and DeepSeek-V3-small shapes with --load-format dummy (random weights made on the GPU: no checkpoint
# written or read), each under `timeout`. Logs and JSON go to $OUT (default ./out); the table is printed last and
# written to $OUT/summary.md.
#
#   bash lab/scripts/moe_gpu.sh [--dry-run]
#
#   BUDGET=400           seconds for the whole run: each stage gets its own limit or what the budget leaves after
#                        the stages still to come have their minimum, whichever is less
#   TEST_TIMEOUT=140 QWEN_TIMEOUT=170 DEEPSEEK_TIMEOUT=90   each stage's own limit
#   SHAPES="qwen3-30b-a3b deepseek-v3-small"   BENCH_ARGS (extra moe_bench.py flags)   PYTHON=python3
#   --dry-run            print each command instead of running it (tests/test_moe_bench.py checks the order)
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
DRY=0; [ "${1:-}" = "--dry-run" ] && DRY=1
ROOT=$(cd "$(dirname "$0")/../.." && pwd); cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-$ROOT/out}; mkdir -p "$OUT"
PY=${PYTHON:-python3}
SHAPES=${SHAPES:-qwen3-30b-a3b deepseek-v3-small}
BUDGET=${BUDGET:-400}; START=$SECONDS
limit() {   # limit WANT RESERVE: WANT seconds, or what the budget leaves after RESERVE if that is less
  local left=$((BUDGET - (SECONDS - START) - $2)); echo $(( $1 < left ? $1 : left ))
}
run() {   # run SECONDS LOG CMD...: under timeout, output to LOG; --dry-run prints the command
  local secs=$1 log=$2; shift 2
  if [ "$DRY" = 1 ]; then echo "+ timeout $secs $*"; return 0; fi
  if [ "$secs" -lt 15 ]; then echo "skipped (budget spent): $*" | tee "$log"; return 0; fi
  timeout "$secs" "$@" > "$log" 2>&1; local rc=$?
  echo "rc=$rc after $((SECONDS - START)) s: $*" | tee -a "$OUT/steps.txt"
  return 0
}
if [ "$DRY" = 0 ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
  git rev-parse --short HEAD 2>/dev/null | tee "$OUT/commit.txt"
  : > "$OUT/steps.txt"
fi

# the benches' own limits are reserved from the tests' share (Qwen3 ~100-130 s, most of it startup; DeepSeek ~60 s)
run "$(limit "${TEST_TIMEOUT:-140}" 260)" "$OUT/tests.log" \
  "$PY" -m pytest -q -p no:cacheprovider -rfE --durations=8 tests/gpu/test_moe_gpu.py
if [ "$DRY" = 0 ]; then
  grep -E "^(T=|device copy|routing)" "$OUT/tests.log"   # the MoE layer's kernel times (printed by a test)
  tail -25 "$OUT/tests.log"
fi

JSONS=()
for shape in $SHAPES; do
  case $shape in
    qwen3-30b-a3b) want=${QWEN_TIMEOUT:-170}; reserve=$([[ $SHAPES == *deepseek* ]] && echo 90 || echo 0);;
    deepseek-v3-small) want=${DEEPSEEK_TIMEOUT:-90}; reserve=0;;
    *) want=150; reserve=0;;
  esac
  run "$(limit "$want" "$reserve")" "$OUT/$shape.log" \
    "$PY" -m benchmarks.moe_bench --shape "$shape" --out "$OUT/$shape.json" ${BENCH_ARGS:-}
  [ "$DRY" = 0 ] && grep -E "^\[moe_bench|Error|error" "$OUT/$shape.log" | tail -12
  JSONS+=("$OUT/$shape.json")
done

if [ "$DRY" = 1 ]; then echo "+ $PY -m lab.moe_table ${JSONS[*]}"; exit 0; fi
echo "total $((SECONDS - START)) s"
"$PY" -m lab.moe_table "${JSONS[@]}" | tee "$OUT/summary.md"
