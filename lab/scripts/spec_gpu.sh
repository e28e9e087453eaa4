#!/usr/bin/env bash
# Speculative decoding on one GPU in one device call: the CUDA spec tests, then benchmarks/spec_bench.py (offline
# chain/tree/adaptive rows and one stream through `kestrel serve`). Logs and JSON go to $OUT (default ./out).
# Carry .whl (lab/scripts/fetch_gpu_wheels.sh) for the server's packages.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-out}; mkdir -p "$OUT"
source lab/scripts/install_gpu_wheels.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpu.txt"
git rev-parse --short HEAD 2>/dev/null | tee "$OUT/commit.txt"
timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -q -p no:cacheprovider tests/gpu/test_spec_gpu.py 2>&1 \
  | tail -15 | tee "$OUT/tests.log"
timeout "${BENCH_TIMEOUT:-400}" python3 -m benchmarks.spec_bench --out "$OUT/spec.json" ${SERVE---serve} ${QUICK:+--quick} \
  > "$OUT/bench.log" 2>&1
tail -40 "$OUT/bench.log"
