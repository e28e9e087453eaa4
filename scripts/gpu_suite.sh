#!/usr/bin/env bash
# The whole GPU suite in one device call: tests/gpu, the engine benchmarks (with the HF transformers peer), the
# HTTP overhead, and the tuning-report table through `kestrel launch ... --then "kestrel bench serve"`.
# Prints a short table last. Results land in $OUT (the device tool's folder) or ./out.
#   bash scripts/gpu_suite.sh [--models qwen3-0.6b,llama-3.1-8b,kestrel-tiny]
#   SERVE_VARIANTS="name:serve-flag:bench-flag ..." picks the server runs (flags in --flag=value form, no spaces),
#   e.g. SERVE_VARIANTS="graphs:: torch:--attention-backend=torch:--output-len=64"
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"; LOG=$OUT/suite.log; WORK=${KESTREL_BENCH_WORKDIR:-/tmp/kestrel-bench}
mkdir -p "$WORK"; : > "$WORK/ab_switches.txt"   # this call's A/B switches, for BENCH_SWITCH=best
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then   # from scripts/fetch_gpu_wheels.sh, carried with the call
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
KESTREL="python3 -m kestrel.cli"
step() { echo "=== $* ($(date +%T))" | tee -a "$LOG"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$LOG"

# STAGES picks what runs (a full run is close to one device call's 10 minutes; split it over two calls if needed):
#   profile: bs1 decode kernel table (benchmarks/profile_decode.py) · tests: tests/gpu · bench: engine benchmarks (+ HF peer) · prologue: engine bench with KESTREL_FUSED_ATTN_PROLOGUE=0
#   ops: fused elementwise ops, Triton vs torch.compile (benchmarks/fused_ops_bench.py)
#   cudagemv: the CUDA C++ skinny matmuls vs cuBLAS at the 8B's shapes (benchmarks/cuda_gemv_bench.py)
#   timeline: the cluster decode kernel's segments, timed inside it (benchmarks/decode_timeline.py)
#   layertimeline: the 8B's bs1 layer chain, each matmul's wait, staging, steps and tail (benchmarks/layer_timeline.py)
#   boundary: a dependent chain of phases: kernel boundaries vs grid barriers, and weights streamed ahead (benchmarks/boundary_bench.py)
#   serve: HTTP overhead (engine process vs --engine-in-thread) and launch + bench serve
STAGES=" ${STAGES:-tests bench serve} "
# A file may need longer than GPU_TEST_TIMEOUT: the skinny-matmul file compiles ~100 kernel variants (K is a
# constexpr), the kernels file's decode matrix ~60 (its decode tests alone took 99 s in session 6).
test_timeout() { case $1 in *test_gemv_gpu.py|*test_kernels_gpu.py) echo $(( ${GPU_TEST_TIMEOUT:-150} * 2 ));;
  *) echo ${GPU_TEST_TIMEOUT:-150};; esac; }
run_tests() {   # run_tests FILE...: one pytest per file, each with its own time limit
  for f in "$@"; do
    KESTREL_GPU_REPORT=$OUT/gpu_parity.json timeout $(test_timeout $f) python3 -m pytest -q -rf --tb=line \
      -p no:cacheprovider $f ${GPU_TEST_ARGS:-} >> "$LOG" 2>&1; echo "$f exit $?" | tee -a "$LOG"
    tail -1 "$LOG"
  done
}
if [[ $STAGES == *" tests "* ]]; then
  step "tests/gpu"
  # One pytest per file, so a slow file cannot hide the others' failure lines.
  run_tests ${GPU_TEST_FILES:-tests/gpu/test_*.py}
fi
if [[ $STAGES == *" ops "* ]]; then
  step "fused elementwise ops: Triton vs torch.compile vs eager (inside CUDA graphs)"
  # OPS_ARGS, e.g. "--ops rotary,qk_prologue", times only some rows.
  timeout ${OPS_TIMEOUT:-300} python3 -m benchmarks.fused_ops_bench --out "$OUT/fused_ops.json" ${OPS_ARGS:-} \
    2>> "$LOG" | tee -a "$LOG"
fi
if [[ $STAGES == *" boundary "* ]]; then
  step "a kernel boundary vs an in-kernel grid barrier, per dependent phase (benchmarks/boundary_bench.py)"
  timeout ${BOUNDARY_TIMEOUT:-240} python3 -m benchmarks.boundary_bench --out "$OUT/boundary.json" ${BOUNDARY_ARGS:-} 2>> "$LOG" | tee -a "$LOG"
fi
if [[ $STAGES == *" cudagemv "* ]]; then
  step "CUDA C++ skinny matmuls vs cuBLAS at the 8B's shapes (benchmarks/cuda_gemv_bench.py)"
  timeout ${CUDA_GEMV_TIMEOUT:-180} python3 -m benchmarks.cuda_gemv_bench --out "$OUT/cuda_gemv.json" 2>> "$LOG" | tee -a "$LOG"
fi
if [[ $STAGES == *" timeline "* ]]; then
  step "cluster decode, timed inside the kernel (benchmarks/decode_timeline.py)"
  timeout ${TIMELINE_TIMEOUT:-120} python3 -m benchmarks.decode_timeline --out "$OUT/decode_timeline.json" 2>> "$LOG" | tee -a "$LOG"
fi
if [[ $STAGES == *" layertimeline "* ]]; then
  step "the 8B's bs1 layer chain, its matmuls timed inside them (benchmarks/layer_timeline.py)"
  # LAYER_TIMELINE_AB="SWITCH ...": a second run per switch ('+' joins switches), e.g. KESTREL_CUDA_GEMV_CONFIG=...
  timeout ${TIMELINE_TIMEOUT:-120} python3 -m benchmarks.layer_timeline --out "$OUT/layer_timeline.json" 2>> "$LOG" | tee -a "$LOG"
  for ab in ${LAYER_TIMELINE_AB:-}; do
    echo "--- $ab" | tee -a "$LOG"
    env ${ab//+/ } timeout ${TIMELINE_TIMEOUT:-120} python3 -m benchmarks.layer_timeline \
      --out "$OUT/layer_timeline_$(echo "$ab" | tr -c 'A-Za-z0-9\n' _).json" 2>> "$LOG" | tee -a "$LOG"
  done
fi
if [[ $STAGES == *" profile "* ]]; then
  if [ "${GEMV_BENCH:-1}" = 1 ]; then
    step "skinny matmul kernels vs cuBLAS"
    timeout 120 python3 -m benchmarks.gemv_bench --out "$OUT/gemv_bench.json" 2>> "$LOG" | tee -a "$LOG"
  fi
  step "bs1 decode profile (kernel table per step), then A/B: each fast-path switch flipped in turn"
  # PROFILE_ARGS, e.g. --like-bench (engine_bench.py's engine sizes), go to the baseline and every A/B.
  timeout 240 python3 -m benchmarks.profile_decode --workdir "$WORK" --out "$OUT/profile.json" \
    --models ${PROFILE_MODELS:-qwen3-0.6b,llama-3.1-8b} ${PROFILE_ARGS:-} 2>> "$LOG" | tee -a "$LOG"
  # [model@]SWITCH[+SWITCH...]: the 0.6B shape unless a model is named; '+' joins switches flipped together.
  # Decided A/Bs leave the list (BENCHMARKS.md, sessions 7 and 8):
  #   Kernels signalling their successor at their start (PDL early signal): +3.8% (0.6B), -0.3% (8B); removed.
  #   The graph's input bookkeeping in one Triton kernel: +0.1% (0.6B); removed.
  #   4 or 2 warps per whole-slice skinny program (fewer registers per SM): +0.3% / +0.6%; removed.
  #   The 8B's matmuls on the Triton skinny kernel, all but gate_up (KESTREL_SKINNY_MAX_MB=120): +6.3%.
  #   L2 prefetch of later weights: +18.8% (0.6B), +2.1% (8B); removed.
  #   Fused logits cast + argmax: -1.5% (0.6B), -0.9% (8B); now the default.
  #   2-warp decode programs: +8%. The old decode defaults (64-key tiles, no prefetch): +6.8% (0.6B), +0.4% (8B).
  #   The 8B's o_proj alone on Triton (KESTREL_SKINNY_MAX_MB=40): +1.2%.
  #   The 8B's bs1 step through the 8-row graph (KESTREL_GRAPH_MIN_BS=8): +1.1%.
  #   Session 9: one 64 KB skinny program per SM (KESTREL_GEMV_PROGRAMS=128): +3.9%; the 0.6B's gate_up alone on
  #   192 wider programs: +0.5%; the 8B's Triton matmuls with PDL off: +7.9% (PDL is not why they lose). Removed.
  # Session 10: KESTREL_FUSED_DECODE_PROLOGUE=1 (rebuilt) +2.6% (0.6B), -0.7% (8B, twice): kept off, in the tree;
  # the 8B's one-row cuBLAS matmuls asked as a column (-0.5%) and TORCH_BLAS_PREFER_CUBLASLT=1 (-0.5%), both in
  # the 8B's noise: the column knob is removed. The one-pass add-RMSNorm is the default (-1.8%; A/B
  # KESTREL_GEMV_ONE_PASS_NORM=0); the decode merge by query head with scalar log-sum-exp loads replaced the
  # merge over the 16 padded rows (-2.2%; the old merge is removed).
  # Session 11: the cluster decode kernel (KESTREL_CLUSTER_DECODE=8, CUDA C++) is the default: the Triton kernel
  # measured +3.9% / +5.2% (0.6B) and +2.2% / -0.4% / +0.6% (8B) against it; 16 programs a kv head -2.0% against
  # the Triton kernel (worse than 8); 8 warps a program -0.9% against 4, 2 warps +5.6%.
  # Session 12: the CUDA C++ skinny matmuls for the 8B (KESTREL_CUDA_GEMV=auto) are the default: cuBLAS
  # (KESTREL_CUDA_GEMV=0) measured +10.8% / +12.4% against them; only qkv and o_proj on them
  # (KESTREL_CUDA_GEMV_MAX_MB=50) -2.6%. Neutral or worse, removed: o_proj's weight pulled into L2 by the decode
  # kernel (bulk -0.15% / +0.1%, per line +3.6% / +4.5%), 4-warp decode programs beside it (+0.3%), the norm
  # weight read after the wait (+0.1%). KESTREL_CUDA_GEMV_CONFIG="NxK=rows,u" overrides a shape's config
  # (o_proj 4,4: -0.2%; qkv 1,16: +0.9%).
  # Session 14: decode on tensor cores (KESTREL_CLUSTER_DECODE_MMA, auto = groups of 4 and more) -2.5% / -2.3%
  # on the 8B (CUDA cores +2.3% against it), +1.9% / +3.7% on the 0.6B (kept on CUDA cores); 1 tile a warp
  # +0.6% and 2 warps +0.4% against 2 tiles and 4 warps; 1-warp programs +2.1% (cluster 16) / +2.7% (8);
  # cluster 4 +0.2%.
  # Session 15: wider tensor-core decode programs (cluster 2 / 4 with 8 warps) +0.3% / +0.2%; the engine's sizes
  # (KESTREL_PROFILE_LIKE_BENCH=1) +0.4%, mostly the graph's index_put of 256 update slots; the torch graph head
  # (KESTREL_FUSED_STEP_INPUTS=0) +1.0% on the 0.6B, -0.1% / -0.3% on the 8B (inside its spread).
  # Session 16: the activation by bulk copy after the wait (KESTREL_CUDA_GEMV_TMA_X) is the default: off measured
  # +4.6% (and -3.7% on when it was the A/B); o_proj without it +0.6%; o_proj's weights after its activation
  # (KESTREL_CUDA_GEMV_PREWAIT_OFF=4096x4096) +0.4%; o_proj a quarter before the wait (4096x4096=2,4) +0.5%.
  # Session 17: one L1/shared split for every NVRTC kernel (KESTREL_CUDA_CARVEOUT) 100 +5.9%, 25 +0.4%; decode
  # signalling after its first keys (KESTREL_CLUSTER_DECODE_SIGNAL=attend) +0.0% (8B), +0.6% (0.6B): both left as
  # switches. Down on one row a warp (4096x14336=1,8: -0.3 to -0.6% in six calls) is now the default. o_proj
  # on 4 or 3 rows a warp (4096x4096=4,4 / 3,4, all its blocks resident beside decode) +0.8% / +0.8%.
  # Ablations (profile_decode.py): KESTREL_PROFILE_ABLATE=decode, =prologue, =decode,prologue, =norm, =silu,
  # =cluster_merge time the step with that work taken
  # out (garbage tokens), to see what the rest costs without it.
  # KESTREL_PDL=0 (+26% on the 0.6B, three times; +1.5% on the 8B in session 9) left earlier. The default list
  # re-measures the reference point: the fused argmax off on both models.
  for ab in ${PROFILE_AB:-KESTREL_FUSED_ARGMAX=0 llama-3.1-8b@KESTREL_FUSED_ARGMAX=0}; do
    model=qwen3-0.6b; switch=$ab
    [[ $ab == *@* ]] && model=${ab%%@*} && switch=${ab#*@}
    echo "--- $model $switch" | tee -a "$LOG"
    tag=$(echo "$switch" | tr -c 'A-Za-z0-9\n' _); echo "${model}_$tag $switch" >> "$WORK/ab_switches.txt"
    # Each A/B's whole kernel table goes to its own JSON; the log keeps the step time.
    env ${switch//+/ } timeout 150 python3 -m benchmarks.profile_decode --workdir "$WORK" --models "$model" \
      --out "$OUT/profile_ab_${model}_$tag.json" ${PROFILE_ARGS:-} \
      2>> "$LOG" | grep -E "^##|engine.step|busy" | tee -a "$LOG"
  done
fi
if [[ $STAGES == *" bench "* ]]; then
  step "engine benchmarks"
  # BENCH_SWITCH=best: bench with the fastest of this call's profile A/Bs if it gained >= 1% (else the defaults).
  BENCH_SWITCH=${BENCH_SWITCH:-}
  if [ "$BENCH_SWITCH" = best ]; then
    BENCH_SWITCH=$(python3 -m benchmarks.ab_summary "$OUT" --best "$WORK/ab_switches.txt" 2>> "$LOG")
    echo "bench switch: ${BENCH_SWITCH:-none (no A/B gained 1%)}" | tee -a "$LOG"
  fi
  env ${BENCH_SWITCH//+/ } timeout ${GPU_BENCH_TIMEOUT:-330} python3 -m benchmarks.engine_bench --workdir "$WORK" \
    --out "$OUT/bench.json" "$@" >> "$LOG" 2>&1; echo "engine bench exit $?" | tee -a "$LOG"
fi
if [[ $STAGES == *" prologue "* ]]; then
  step "fused attention prologue off (bs1 and 128 concurrent, no HF peer)"
  KESTREL_FUSED_ATTN_PROLOGUE=0 timeout 240 python3 -m benchmarks.engine_bench --workdir "$WORK" --skip-hf \
    --prefix-bench none --models ${PROLOGUE_MODELS:-qwen3-0.6b,llama-3.1-8b} --out "$OUT/bench_prologue.json" \
    >> "$LOG" 2>&1; echo "prologue bench exit $?" | tee -a "$LOG"
  python3 -m benchmarks.report "$OUT/bench_prologue.json" | grep -E "^\*\*|graphs|eager" | head -12
fi

MODEL=$WORK/${SERVE_MODEL:-llama-3.1-8b}
if [[ $STAGES == *" serve "* ]]; then
  [ -d "$MODEL" ] || python3 -c "from benchmarks.shapes import write_random_checkpoint as w; from pathlib import Path; \
    w('${SERVE_MODEL:-llama-3.1-8b}', Path('$MODEL'))" >> "$LOG" 2>&1
  [ -d "$WORK/qwen3-0.6b" ] || python3 -c "from benchmarks.shapes import write_random_checkpoint as w; \
    from pathlib import Path; w('qwen3-0.6b', Path('$WORK/qwen3-0.6b'))" >> "$LOG" 2>&1
  step "HTTP overhead (qwen3-0.6b shape): engine process, then --engine-in-thread"
  timeout 100 python3 benchmarks/http_overhead.py --model "$WORK/qwen3-0.6b" \
    --max-tokens 256 --repeats 3 > "$OUT/http_overhead.json" 2>> "$LOG"
  [ "${HTTP_THREAD:-1}" = 1 ] && timeout 100 python3 benchmarks/http_overhead.py --model "$WORK/qwen3-0.6b" \
    --serve-arg=--engine-in-thread --max-tokens 256 --repeats 3 > "$OUT/http_overhead_thread.json" 2>> "$LOG"
  grep -h overhead_pct "$OUT"/http_overhead*.json
  # name:extra serve flags:extra bench flags — the slow eager backends run 64-token outputs to save device time.
  SERVE_VARIANTS=${SERVE_VARIANTS:-"graphs:: eager:--disable-cuda-graph:"}
  files=(); labels=()
  for v in $SERVE_VARIANTS; do
    [ "$v" = none ] && continue
    IFS=: read -r name serve_flags bench_flags <<< "$v"
    step "launch + bench serve single-and-peak: $name"
    timeout 330 $KESTREL launch --name "kestrel-$name" --ready-timeout 300 --stall-timeout 60 \
      --then "$KESTREL bench serve --base-url {base_url} --preset single-and-peak --label kestrel-$name \
              --no-progress $bench_flags --output $OUT/serve_$name.json" \
      -- $KESTREL serve "$MODEL" --port 8011 $serve_flags >> "$LOG" 2>&1
    echo "launch exit $?" | tee -a "$LOG"
    files+=("$OUT/serve_$name.json"); labels+=("kestrel-$name")
  done
  [ ${#files[@]} -gt 0 ] && $KESTREL bench compare "${files[@]}" --labels "$(IFS=,; echo "${labels[*]}")" \
    > "$OUT/serve_comparison.md" 2>> "$LOG"
fi
if [ -n "${LATE_TEST_FILES:-}" ]; then   # tests to run after the measurements, so their compiles cannot disturb them
  step "late tests/gpu files"
  run_tests $LATE_TEST_FILES
fi
grep -E "Traceback|Error" "$LOG" | sort | uniq -c | head -20
step "summary"
python3 -m benchmarks.ab_summary "$OUT" 2>/dev/null | tee "$OUT/ab_summary.md"   # profile A/Bs vs their baselines
cat "$OUT/serve_comparison.md" 2>/dev/null | head -30
[ -f "$OUT/bench.json" ] && python3 -m benchmarks.report "$OUT/bench.json" --parity "$OUT/gpu_parity.json"
# The device tool brings back at most 8 files from $OUT: past that, every JSON goes into one archive.
if [ "$(find "$OUT" -maxdepth 1 -type f | wc -l)" -gt 8 ]; then
  (cd "$OUT" && tar czf results.tar.gz --exclude results.tar.gz ./*.json ./*.md 2>/dev/null \
    && find . -maxdepth 1 -name '*.json' -delete && echo "JSON packed into $OUT/results.tar.gz")
fi
