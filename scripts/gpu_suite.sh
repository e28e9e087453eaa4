#!/usr/bin/env bash
# The whole GPU suite in one device call: tests/gpu, then the benchmarks; prints a short table last.
#   run (device): bash scripts/gpu_suite.sh [bench args...]     results land in $OUT (or ./out)
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
git rev-parse --short HEAD 2>/dev/null > "$OUT/commit.txt" || true
KESTREL_GPU_REPORT=$OUT/gpu_parity.json timeout ${GPU_TEST_TIMEOUT:-240} python3 -m pytest -q -x tests/gpu \
  -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
timeout ${GPU_BENCH_TIMEOUT:-420} python3 -m benchmarks.engine_bench --out "$OUT/bench.json" "$@" > "$OUT/bench.log" 2>&1
echo "bench exit $?"; grep -E "ERROR|Traceback|Error" "$OUT/bench.log" | head -20
python3 -m benchmarks.report "$OUT/bench.json" --parity "$OUT/gpu_parity.json"
