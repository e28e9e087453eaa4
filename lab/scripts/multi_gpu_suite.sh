#!/usr/bin/env bash
# One device call on a 2- or 4-GPU host for issue #37 (~570 s, carry [".whl-lite"]): tensor parallelism measured.
#
#   nvidia-smi (and the GPUs' link topology)
#   benchmarks/all_reduce_bench.py at the host's GPU count: NCCL vs the symmetric-memory road per message size,
#     in CUDA graphs and eager, and the 8B decode step's all-reduce time (65 x 8 KB)
#   pytest tests/gpu/test_tp_gpu.py (TP=2 tokens equal one GPU's; the custom all-reduce gives NCCL's tokens)
#   benchmarks/engine_bench.py, Llama-3.1-8B shape (random weights), --graphs-only --skip-hf, at TP=1, 2, 4 (those
#     the host has GPUs for), then the largest TP again with --disable-custom-all-reduce
#   benchmarks/sigterm_check.py: kestrel serve at the largest TP, SIGTERM mid-request, exit within 30 s with status
#     0, no process of its tree nor a kestrel.ranks.worker left
#   the table (lab/multi_gpu_table.py), printed last
#
#   bash lab/scripts/multi_gpu_suite.sh [--dry-run]      (--dry-run: the commands and their time limits, on any machine)
#   END=570      seconds for the whole call: each step is cut to what the budget leaves after the steps to come
#   TPS="1 2 4"  the engine runs (default: those of 1 2 4 that fit the GPUs); AR_WORLDS the all-reduce bench's rank
#                counts (default: every GPU); COMMIT=SHA names the tree in the table where it has no .git
#
# Results: $OUT (the device tool's folder, else ./out): summary.md (the table) and multi_gpu.tgz (every step's
# JSON and log, summary.json): two files, inside the tool's eight. NVLink multicast stays off throughout.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
DRY=0; [ "${1:-}" = --dry-run ] && DRY=1
cd "$(dirname "$0")/../.." || exit 2
OUT=${OUT:-$PWD/out}; O=/tmp/multi-gpu; rm -rf "$O"; mkdir -p "$O" "$OUT"; LOG=$O/suite.log; : > "$LOG"
WORK=${BENCH_WORKDIR:-/tmp/kestrel-bench}; MODEL=llama-3.1-8b; T0=$SECONDS; END=${END:-570}
if [ $DRY = 0 ]; then source lab/scripts/install_gpu_wheels.sh > /dev/null 2>&1; else export PYTHONPATH=$PWD:/tmp/site; fi

lim() { local l=$(( END - (SECONDS - T0) - $2 )); echo $(( $1 < l ? $1 : l )); }   # lim WANT RESERVE
st() { echo "=== $* ($((SECONDS - T0)) s)" | tee -a "$LOG"; }
# run LIMIT LOGFILE CMD...: CMD under a time limit, its output in LOGFILE; skipped when under 10 s are left
run() {
  local limit=$1 log=$2; shift 2
  if [ $DRY = 1 ]; then echo "[dry-run] timeout $limit $(printf '%q ' "$@")> $log" | tee -a "$LOG"; return 0; fi
  if [ "$limit" -lt 10 ]; then
    echo "skipped: the budget is spent" > "$log"; echo "skipped: $*" >> "$LOG"; return 124
  fi
  timeout "$limit" "$@" > "$log" 2>&1; local rc=$?
  echo "rc=$rc" >> "$log"; echo "exit $rc" | tee -a "$LOG"; return $rc
}
# A rank a timed-out step left behind (ours: nothing else runs on this host) would hold its GPU: killed by pid, said.
reap() {
  [ $DRY = 1 ] && return 0
  local p; for p in $(pgrep -f "kestrel.ranks.worker|benchmarks.all_reduce_bench --rank"); do
    echo "left behind by $1: $(ps -o pid=,args= -p "$p" | cut -c1-120); killed" | tee -a "$LOG"; kill -9 "$p"; done
}
one_line() {   # one engine run's figures, from its report
  python3 -c "import sys; from pathlib import Path; from lab.multi_gpu_table import engine_row, load
r = engine_row(load(Path(sys.argv[1])), sys.argv[2]); print(r.get('error') or ', '.join(f'{k} {r[k]:.1f}' for k in
('bs1_tok_s', 'c128_tok_s', 'ttft_ms', 'startup_s') if r.get(k)))" "$1" "$MODEL" 2>&1 | tail -1 | tee -a "$LOG"
}

st "nvidia-smi"
if [ $DRY = 1 ]; then NGPU=${NGPU:-4}; else
  nvidia-smi > "$O/gpu.txt" 2>&1; nvidia-smi topo -m >> "$O/gpu.txt" 2>&1
  echo "commit ${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo '?')}" >> "$O/gpu.txt"
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
    >> "$O/gpu.txt" 2>&1
  NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU'); nvidia-smi -L | tee -a "$LOG"
fi
TPS=${TPS:-$(for t in 1 2 4; do [ "$t" -le "$NGPU" ] && printf '%s ' $t; done)}
MAX=$(printf '%s\n' $TPS | sort -n | tail -1); AR_WORLDS=${AR_WORLDS:-$NGPU}
RUNS=(); for t in $TPS; do RUNS+=("$t:"); done; [ "$MAX" -gt 1 ] && RUNS+=("$MAX:nccl")
# The least each step to come is kept (seconds; each takes less than its cap, typically): the tests 90, an engine
# run 65 (startup ~25 s at any TP once the kernels are compiled, bs1 and c128 ~15 s), the SIGTERM check 75.
TESTS_MIN=90; ENGINE_EACH=65; SIG=75; TAIL=15
echo "$NGPU GPU(s); engine runs ${RUNS[*]}; all-reduce bench at ${AR_WORLDS}" | tee -a "$LOG"

for w in $AR_WORLDS; do
  st "all-reduce bench, $w ranks"
  l=$(lim 60 $((TESTS_MIN + ${#RUNS[@]} * ENGINE_EACH + SIG + TAIL)))
  # its own timeout a little inside the step's, so that it kills its ranks and marks the report incomplete itself
  run "$l" "$O/ar_tp$w.log" python3 -m benchmarks.all_reduce_bench --world-size "$w" --out "$O/ar_tp$w.json" \
    --timeout $((l > 15 ? l - 8 : l))
  grep -vE "^rc=|INFO" "$O/ar_tp$w.log" 2>/dev/null | tail -12 | tee -a "$LOG"; reap "the all-reduce bench"
done

st "tests/gpu/test_tp_gpu.py"
run "$(lim 120 $((${#RUNS[@]} * ENGINE_EACH + SIG + TAIL)))" "$O/tests.log" \
  python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/gpu/test_tp_gpu.py
tail -5 "$O/tests.log" 2>/dev/null | tee -a "$LOG"; reap "the tests"

i=0
for r in "${RUNS[@]}"; do
  tp=${r%%:*}; road=${r#*:}; i=$((i + 1)); name=bench_tp$tp${road:+_$road}
  st "engine bench $MODEL TP=$tp${road:+ (--disable-custom-all-reduce)}"
  # the first run also writes the random-weight checkpoint (~30 s), which the others and the SIGTERM check reuse
  want=110; [ $i = 1 ] && want=140
  l=$(lim $want $(((${#RUNS[@]} - i) * ENGINE_EACH + SIG + TAIL)))
  run "$l" "$O/$name.log" python3 -m benchmarks.engine_bench --workdir "$WORK" --models "$MODEL" --skip-hf \
    --graphs-only --prefix-bench none --tensor-parallel-size "$tp" ${road:+--disable-custom-all-reduce} \
    --out "$O/$name.json"
  [ $DRY = 1 ] || one_line "$O/$name.json"; reap "engine bench TP=$tp"
done

st "SIGTERM check: kestrel serve TP=$MAX"
if [ $DRY = 1 ] || [ ! -f "$WORK/$MODEL/.complete" ]; then   # the engine runs did not write it
  run "$(lim 80 60)" "$O/checkpoint.log" python3 -c "from pathlib import Path; from benchmarks.shapes import \
write_random_checkpoint as w; w('$MODEL', Path('$WORK/$MODEL'))"
fi
l=$(lim 110 $TAIL)
# ready within what is left after the exit (30 s) and the reaping (at most 10 s)
run "$l" "$O/sigterm_run.log" python3 -m benchmarks.sigterm_check "$WORK/$MODEL" --tensor-parallel-size "$MAX" \
  --device cuda --port 8021 --ready-timeout $((l > 50 ? l - 42 : 8)) --exit-timeout 30 --out "$O/sigterm.json"
tail -2 "$O/sigterm_run.log" 2>/dev/null | tee -a "$LOG"; reap "the SIGTERM check"

st "summary"
python3 -m lab.multi_gpu_table "$O" --model "$MODEL" --json "$O/summary.json" > "$O/summary.md" 2>> "$LOG"
cp "$O/summary.md" "$OUT/summary.md"; tar czf "$OUT/multi_gpu.tgz" -C "$O" .
echo; cat "$O/summary.md"
