#!/usr/bin/env bash
# Issues 51, 53, 54 on one card, one call, in priority order until BUDGET seconds: the FP8 GPU tests (W8A8 block
# GEMM, FP8 KV cache, block-FP8 MoE); the batch GEMM roads on the 8B layers (benchmarks/fp8_gemm_bench.py); the
# 128-row decode step profiled for FP8 W8A8 (the new default) and bf16; the first burst after ready against the warm
# one (benchmarks/first_burst.py, kernels built in between listed); structured outputs' cost at 32 concurrent (needs
# xgrammar carried: carry [".whl"], lab/scripts/fetch_gpu_wheels.sh); the FP8 KV cache at 128 concurrent; then the
# W8A16 step, the FP8 first burst and the MoE tile tuning if time is left. Results packed into $OUT/fp8_batch.tgz.
#   device: COMMIT=<sha> BUDGET=480 bash lab/scripts/fp8_batch_gpu.sh
set -u
[ -d .whl ] && source lab/scripts/install_gpu_wheels.sh   # xgrammar for structured_bench, when carried
export NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
R=/tmp/fp8_batch; mkdir -p $R; W=/tmp/kestrel-bench; BUDGET=${BUDGET:-480}
log() { echo "=== $* ($(date +%T), ${SECONDS}s)" | tee -a $R/steps.txt; }
left() { local l=$((BUDGET - SECONDS)); echo $(( $1 < l ? $1 : l )); }
pack() { tar -czf $OUT/fp8_batch.tgz -C /tmp fp8_batch; }
trap pack EXIT
step_profile() {   # step_profile NAME SWITCH [ARGS...]
  local name=$1 sw=$2; shift 2
  log "step_profile 8B c128 $name"
  KESTREL_FP8_BLOCK_GEMM=$sw timeout $(left 100) python3 -m benchmarks.step_profile --shape llama-3.1-8b --batch 128 \
    --workdir $W --out $R/step_$name.json "$@" > $R/step_$name.log 2>&1
  log "step_profile $name exit $? · $(tail -1 $R/step_$name.log)"
}
first_burst() {   # first_burst NAME [ARGS...]
  local name=$1; shift
  log "first burst 8B $name"
  timeout $(left 130) python3 -m benchmarks.first_burst --workdir $W --out $R/first_burst_$name.json "$@" \
    > $R/first_burst_$name.log 2>&1
  log "first burst $name exit $? · $(grep -m1 c128 $R/first_burst_$name.log)"
}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $R/gpu.txt
echo "commit ${COMMIT:-?}" >> $R/gpu.txt
python3 -c "import torch, triton; print(torch.__version__, torch.version.cuda, triton.__version__)" >> $R/gpu.txt
log "GPU tests: FP8 block GEMMs (the first-traffic test is the first_burst benchmark's job below)"
timeout $(left 90) python3 -m pytest -q tests/gpu/test_fp8_gpu.py -k "block_gemm or w8a8" > $R/tests.log 2>&1
log "tests exit $? · $(tail -1 $R/tests.log)"
log "fp8_gemm_bench"
timeout $(left 80) python3 -m benchmarks.fp8_gemm_bench --budget-s ${SWEEP_S:-30} --out $R/fp8_gemm.json > $R/fp8_gemm.log 2>&1
log "fp8_gemm_bench exit $?"
log "GPU tests: FP8 KV cache (issue 53), block-FP8 MoE experts"
timeout $(left 90) python3 -m pytest -q tests/gpu/test_kv_cache_fp8_gpu.py tests/gpu/test_moe_fp8_gpu.py \
  > $R/tests_kv_moe_fp8.log 2>&1
log "kv / moe fp8 tests exit $? · $(tail -1 $R/tests_kv_moe_fp8.log)"
step_profile w8a8 w8a8 --fp8-block
step_profile bf16 w8a8
first_burst bf16
if [ $(left 999) -gt 90 ] && python3 -c "import xgrammar" 2>/dev/null; then   # carried in .whl (fetch_gpu_wheels.sh)
  log "structured_bench 8B c32"
  timeout $(left 120) python3 -m benchmarks.structured_bench --shape llama-3.1-8b --concurrency 32 \
    --workdir $W --out $R/structured.json > $R/structured.log 2>&1
  log "structured_bench exit $? · $(tail -1 $R/structured.log)"
fi
if [ $(left 999) -gt 90 ]; then
  log "kv_cache_fp8_bench 8B c128"
  timeout $(left 120) python3 -m benchmarks.kv_cache_fp8_bench --model llama-3.1-8b --workdir $W \
    --out $R/kv_fp8.json > $R/kv_fp8.log 2>&1
  log "kv_cache_fp8_bench exit $? · $(tail -1 $R/kv_fp8.log)"
fi
[ $(left 999) -gt 80 ] && step_profile w8a16 w8a16 --fp8-block
[ $(left 999) -gt 100 ] && first_burst fp8 --fp8-block
b=$(left 150); if [ $b -gt 60 ]; then
  log "moe_tune qwen3-30b-a3b"
  timeout $b python3 -m benchmarks.moe_tune --budget-s $((b - 30)) --out-dir $R/moe_configs --json $R/moe_tune.json \
    > $R/moe_tune.log 2>&1
  log "moe_tune exit $?"
fi
cat $R/steps.txt; tail -30 $R/fp8_gemm.log; grep -A20 "c128" $R/first_burst_bf16.log | head -20; grep -E "passed|failed|Error" $R/tests.log | tail -5
