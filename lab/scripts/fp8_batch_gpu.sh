#!/usr/bin/env bash
# Issue 51, FP8 at batch: the batch GEMM roads on the 8B layers (benchmarks/fp8_gemm_bench.py), the FP8 GPU tests,
# and the 128-row decode step profiled for bf16, FP8 W8A8 (the new default) and FP8 W8A16 (the old road), one
# call, one card. Results packed into $OUT/fp8_batch.tgz.
#   device: bash lab/scripts/fp8_batch_gpu.sh      (COMMIT=<sha> names the tree)
set -u
export NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD
R=/tmp/fp8_batch; mkdir -p $R; W=/tmp/kestrel-bench
log() { echo "=== $* ($(date +%T))" | tee -a $R/steps.txt; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $R/gpu.txt
echo "commit ${COMMIT:-?}" >> $R/gpu.txt
python3 -c "import torch, triton; print(torch.__version__, torch.version.cuda, triton.__version__)" >> $R/gpu.txt
log "GPU tests: tests/gpu/test_fp8_gpu.py"
timeout 150 python3 -m pytest -q -x tests/gpu/test_fp8_gpu.py -k "block_gemm or w8a8 or engine" > $R/tests_fp8.log 2>&1
log "tests exit $? · $(tail -1 $R/tests_fp8.log)"
log "fp8_gemm_bench"
timeout 200 python3 -m benchmarks.fp8_gemm_bench --budget-s ${SWEEP_S:-80} --out $R/fp8_gemm.json > $R/fp8_gemm.log 2>&1
log "fp8_gemm_bench exit $?"
for v in bf16 w8a8 w8a16; do
  args=(); [ $v != bf16 ] && args=(--fp8-block)
  log "step_profile 8B c128 $v"
  KESTREL_FP8_BLOCK_GEMM=$([ $v = w8a16 ] && echo w8a16 || echo w8a8) timeout 150 python3 -m benchmarks.step_profile \
    --shape llama-3.1-8b --batch 128 --workdir $W --out $R/step_$v.json "${args[@]}" > $R/step_$v.log 2>&1
  log "step_profile $v exit $? · $(tail -1 $R/step_$v.log)"
done
tar -czf $OUT/fp8_batch.tgz -C /tmp fp8_batch
cat $R/steps.txt; tail -30 $R/fp8_gemm.log
