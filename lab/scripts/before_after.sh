#!/usr/bin/env bash
# Before/after in one device call: this tree's kestrel/ against a baseline's (.baseline/kestrel, carried), both
# driven by THIS tree's benchmarks/ (so a change of method cannot pass for a change of speed):
#   bench   benchmarks/engine_bench.py --graphs-only on the Llama-3.1-8B shape (random weights): bs1 decode, 128
#           concurrent, TTFT, startup, graph memory
#   spec    benchmarks/spec_bench.py --quick on the same shape: EAGLE-3 K=3 chain at synthetic L=3 (and L=1.15
#           adaptive, a tree), bs1
#   prof    benchmarks/step_profile.py: where a 128-row decode step's time goes (not in the default STEPS)
# STEPS="bench:base bench:cur bench:cur bench:base spec:base spec:cur" (the default) runs them in that order (the
# trees alternate so drift hits both alike); END=SECONDS (default 585) skips a step that would not fit.
# Make the baseline here (git-ignored):
#   rm -rf .baseline && mkdir .baseline && git archive REV -- kestrel | tar -x -C .baseline && echo REV > .baseline/COMMIT
# and carry [".baseline"]. Results: $OUT (or ./out): table.md (printed last) and before_after.tgz (a JSON and a log
# per step, steps.txt).
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
ROOT=$(pwd); FINAL=${OUT:-$ROOT/out}; O=/tmp/before_after; rm -rf "$O"; mkdir -p "$O" "$FINAL"; W=${BENCH_WORKDIR:-/tmp/kestrel-bench}; mkdir -p "$W"
T0=$SECONDS; END=${END:-585}
[ -d .baseline/kestrel ] || { echo "no .baseline/kestrel: see the header" >&2; exit 2; }
for t in base cur; do
  rm -rf /tmp/trees/$t; mkdir -p /tmp/trees/$t
  cp -r benchmarks models /tmp/trees/$t/
done
cp -r .baseline/kestrel /tmp/trees/base/; cp -r kestrel /tmp/trees/cur/
# more trees to bisect with (carried too): .alt/NAME/kestrel runs as STEPS "bench:NAME"
for alt in .alt/*/; do [ -d "$alt/kestrel" ] || continue; n=$(basename "$alt"); rm -rf /tmp/trees/$n
  mkdir -p /tmp/trees/$n; cp -r benchmarks models "$alt/kestrel" /tmp/trees/$n/; echo "tree $n: $(cat "$alt/COMMIT" 2>/dev/null)" | tee -a "$O/steps.txt"; done
# the benchmarks' fresh-prompt helper (pure Python) is newer than some baselines: the same method on both trees
BASE_COMMIT=$(cat .baseline/COMMIT 2>/dev/null || echo "?"); CUR_COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo "?")}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "$gpu · cur $CUR_COMMIT · base $BASE_COMMIT" | tee "$O/steps.txt"
# step KIND TREE N MIN MAX: run KIND from /tmp/trees/TREE (its kestrel first on the path), output $O/KIND_TREE_N.*
step() { local kind=$1 tree=$2 n=$3 min=$4 max=$5; local left=$(( END - (SECONDS - T0) - 10 ))
  local t=$(( max < left ? max : left )); local name=${kind}_${tree}_$n
  echo "=== $name (limit $t s, at $((SECONDS - T0)) s)" | tee -a "$O/steps.txt"
  if [ $t -lt $min ]; then echo "skipped: $left s left" | tee -a "$O/steps.txt"; return; fi
  local cmd
  # the benchmarks' fresh-prompt helper (pure Python) is newer than some trees: the same method on every tree
  [ -f /tmp/trees/$tree/kestrel/bench/fresh.py ] || cp kestrel/bench/fresh.py /tmp/trees/$tree/kestrel/bench/
  case $kind in
    bench) cmd=(python3 -m benchmarks.engine_bench --in-process --only kestrel --workdir "$W" --models llama-3.1-8b
                --graphs-only --prefix-bench none --out "$O/$name.json");;
    spec)  cmd=(python3 -m benchmarks.spec_bench --workdir "$W" --quick --out "$O/$name.json");;
    prof)  cmd=(python3 -m benchmarks.step_profile --workdir "$W" --shape llama-3.1-8b --batch 128 --out "$O/$name.json");;
  esac
  (cd /tmp/trees/$tree && PYTHONPATH=/tmp/trees/$tree timeout $t "${cmd[@]}") > "$O/$name.log" 2>&1
  echo "rc=$?" | tee -a "$O/$name.log" "$O/steps.txt"; tail -2 "$O/$name.log" | head -1 | tee -a "$O/steps.txt"; }
declare -A seen
for s in ${STEPS:-bench:base bench:cur bench:cur bench:base spec:base spec:cur}; do
  kind=${s%%:*}; tree=${s##*:}; key=${kind}_$tree; seen[$key]=$(( ${seen[$key]:-0} + 1 ))
  case $kind in bench) step bench $tree ${seen[$key]} 60 150;; spec) step spec $tree ${seen[$key]} 60 200;;
                 prof) step prof $tree ${seen[$key]} 40 120;; esac
done
python3 lab/scripts/before_after_table.py "$O" "$gpu" "$BASE_COMMIT" "$CUR_COMMIT" | tee "$O/table.md"
# what comes back from a device call is a few files: the table, and everything in one archive
cp "$O/table.md" "$FINAL/"; tar czf "$FINAL/before_after.tgz" -C "$O" .
