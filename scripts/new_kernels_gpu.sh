#!/usr/bin/env bash
# One device call (~575 s, carry [".whl-lite"]) for the kernels that have not yet run on a GPU: tests/gpu for FP8,
# MoE and speculation, then the Llama-3.1-8B shape bf16 vs --quantization fp8 (same call), Qwen3-30B-A3B bs1
# (moe_bench), kestrel-tiny speculation (drafter_bench) and an 8B cold start with --compile-workers 4.
# Results in $OUT/call3.tgz (steps.txt holds the short table). END=SECONDS shortens it.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
O=/tmp/o3; mkdir -p $O; T0=$SECONDS; END=${END:-575}
source scripts/install_gpu_wheels.sh > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $O/gpu.txt
lim() { local l=$(( END - (SECONDS - T0) - $2 )); echo $(( $1 < l ? $1 : l )); }
st() { echo "=== $* ($((SECONDS - T0)) s)" | tee -a $O/steps.txt; }
for f in fp8 moe spec; do st tests $f
  timeout $(lim 110 380) python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/gpu/test_${f}_gpu.py > $O/tests_$f.log 2>&1
  echo "rc=$?" >> $O/tests_$f.log; tail -4 $O/tests_$f.log | tee -a $O/steps.txt; done
st engine bench bf16 vs fp8
STAGES=bench MODELS=llama-3.1-8b SUITE_BUDGET=$(lim 95 220) BENCH_TIMEOUT=95 OUT=$O/bf16 bash scripts/gpu_suite.sh > /dev/null 2>&1
STAGES=bench MODELS=llama-3.1-8b SUITE_BUDGET=$(lim 95 160) BENCH_TIMEOUT=95 OUT=$O/fp8 bash scripts/gpu_suite.sh --quantization fp8 > /dev/null 2>&1
cat $O/bf16/summary.md $O/fp8/summary.md | grep -v "^$" | tee -a $O/steps.txt
st moe bench; timeout $(lim 120 100) python3 -m benchmarks.moe_bench --shape qwen3-30b-a3b --out $O/moe_qwen3.json > $O/moe.log 2>&1; tail -8 $O/moe.log | tee -a $O/steps.txt
st drafter bench; timeout $(lim 60 40) python3 -m benchmarks.drafter_bench --target $PWD/models/kestrel-tiny --drafter $PWD/models/kestrel-tiny-eagle3 --prompts 8 --device cuda --out $O/drafter_cur.json > $O/drafter.log 2>&1; tail -10 $O/drafter.log | tee -a $O/steps.txt
st cold 8B workers 4; timeout $(lim 80 0) python3 -m benchmarks.cold_start /tmp/kestrel-bench/llama-3.1-8b --device cuda --out $O/cold_8b_w4.json -- --compile-workers 4 > $O/cold.log 2>&1; tail -2 $O/cold.log | tee -a $O/steps.txt
st done; tar czf $OUT/call3.tgz -C $O .
