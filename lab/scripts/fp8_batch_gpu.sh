#!/usr/bin/env bash
# Issue 51 on one card, one call: the FP8 GPU tests and the first-traffic test, the first burst after ready against
# the warm one (benchmarks/first_burst.py, kernels built in between listed), the batch GEMM roads on the 8B layers
# (benchmarks/fp8_gemm_bench.py), and the 128-row decode step profiled for bf16, FP8 W8A8 (the new default) and FP8
# W8A16 (the old road). Results packed into $OUT/fp8_batch.tgz.
#   device: COMMIT=<sha> bash lab/scripts/fp8_batch_gpu.sh
set -u
export NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD
R=/tmp/fp8_batch; mkdir -p $R; W=/tmp/kestrel-bench; BUDGET=${BUDGET:-560}
log() { echo "=== $* ($(date +%T), ${SECONDS}s)" | tee -a $R/steps.txt; }
left() { local l=$((BUDGET - SECONDS)); echo $(( $1 < l ? $1 : l )); }
pack() { tar -czf $OUT/fp8_batch.tgz -C /tmp fp8_batch; }
trap pack EXIT
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $R/gpu.txt
echo "commit ${COMMIT:-?}" >> $R/gpu.txt
python3 -c "import torch, triton; print(torch.__version__, torch.version.cuda, triton.__version__)" >> $R/gpu.txt
log "GPU tests: FP8 block GEMMs, first traffic"
timeout $(left 150) python3 -m pytest -q -x tests/gpu/test_fp8_gpu.py tests/gpu/test_first_traffic_gpu.py \
  -k "block_gemm or w8a8 or first_traffic or burst" > $R/tests.log 2>&1
log "tests exit $? · $(tail -1 $R/tests.log)"
log "first burst 8B bf16"
timeout $(left 130) python3 -m benchmarks.first_burst --workdir $W --out $R/first_burst_bf16.json > $R/first_burst_bf16.log 2>&1
log "first burst exit $? · $(grep -m1 c128 $R/first_burst_bf16.log)"
log "fp8_gemm_bench"
timeout $(left 170) python3 -m benchmarks.fp8_gemm_bench --budget-s ${SWEEP_S:-60} --out $R/fp8_gemm.json > $R/fp8_gemm.log 2>&1
log "fp8_gemm_bench exit $?"
for v in w8a8 bf16 w8a16; do
  args=(); [ $v != bf16 ] && args=(--fp8-block)
  log "step_profile 8B c128 $v"
  KESTREL_FP8_BLOCK_GEMM=$([ $v = w8a16 ] && echo w8a16 || echo w8a8) timeout $(left 100) python3 -m benchmarks.step_profile \
    --shape llama-3.1-8b --batch 128 --workdir $W --out $R/step_$v.json "${args[@]}" > $R/step_$v.log 2>&1
  log "step_profile $v exit $? · $(tail -1 $R/step_$v.log)"
done
log "first burst 8B FP8 W8A8"
timeout $(left 130) python3 -m benchmarks.first_burst --fp8-block --workdir $W --out $R/first_burst_fp8.json > $R/first_burst_fp8.log 2>&1
log "first burst fp8 exit $? · $(grep -m1 c128 $R/first_burst_fp8.log)"
log "moe_tune qwen3-30b-a3b"
b=$(left 150); [ $b -gt 40 ] && timeout $b python3 -m benchmarks.moe_tune --budget-s $((b - 30)) --out-dir $R/moe_configs \
  --json $R/moe_tune.json > $R/moe_tune.log 2>&1
log "moe_tune exit $?"
cat $R/steps.txt; tail -28 $R/fp8_gemm.log; grep -A30 "c128" $R/first_burst_bf16.log | head -30
