#!/usr/bin/env bash
# One device call (~590 s, carry [".whl-lite"]) for the kernels that have not yet run on a GPU, most needed first:
# tests/gpu for FP8; the Llama-3.1-8B shape bf16 against an FP8 block-128 checkpoint (the split-K kernel) and against
# --quantization fp8 (per-channel, quantized at load), all in this call; the per-layer FP8 GEMV times; Qwen3-30B-A3B
# bs1 (moe_bench); tests/gpu for MoE and speculation; kestrel-tiny speculation (drafter_bench).
# Results in $OUT/call3.tgz; steps.txt holds the short table (also printed). END=SECONDS shortens it. A step that
# would not fit in what is left is skipped and says so. ORDER="moe moe_tests ..." picks and orders the steps.
cd "$(dirname "$0")/../.." || exit 2
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
O=/tmp/o3; mkdir -p $O; T0=$SECONDS; END=${END:-590}; W=/tmp/kestrel-bench; mkdir -p $W
source lab/scripts/install_gpu_wheels.sh > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $O/gpu.txt
st() { echo "=== $* ($((SECONDS - T0)) s)" | tee -a $O/steps.txt; }
# run NAME MIN_S MAX_S CMD...: CMD under min(MAX_S, what is left), or skipped when under MIN_S is left
run() { local name=$1 min=$2 max=$3; shift 3; local left=$(( END - (SECONDS - T0) - 5 ))
  local t=$(( max < left ? max : left )); st "$name (limit $t s)"
  if [ $t -lt $min ]; then echo "skipped: $left s left" | tee -a $O/steps.txt; return; fi
  timeout $t "$@" > $O/$name.log 2>&1; echo "rc=$?" >> $O/$name.log; tail -3 $O/$name.log | tee -a $O/steps.txt; }
bench() { local name=$1; shift
  run "$name" 60 ${BENCH_MAX:-110} python3 -m benchmarks.engine_bench --in-process --only kestrel --workdir $W --models llama-3.1-8b --graphs-only \
    --prefix-bench none --out $O/$name.json "$@"; }
pyt() { run "tests_$1" 30 $2 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/gpu/test_$1_gpu.py; }

step_fp8_tests() { pyt fp8 100; }
step_bf16() { bench bf16; }
# base_bf16: the same bf16 bench from another commit's tree in .baseline/ (carry it; see lab/README.md's
# before/after), for a before/after inside this call
step_base_bf16() { [ -d .baseline/kestrel ] || { st "base_bf16"; echo "skipped: no .baseline/" | tee -a $O/steps.txt; return; }
  (cd .baseline && PYTHONPATH=$PWD bench base_bf16); }
step_fp8_block() { BENCH_MAX=140 bench fp8_block --fp8-checkpoint block; }
step_fp8_gemv() { run fp8_gemv 20 50 python3 -m benchmarks.fp8_gemv_bench --no-sweep --out $O/fp8_gemv.json; }
step_moe() { run moe 60 110 python3 -m benchmarks.moe_bench --shape qwen3-30b-a3b --out $O/moe_qwen3.json; }
step_moe_tests() { pyt moe 80; }
step_spec_tests() { pyt spec 60; }
step_two_llms() { pyt two_llms 60; }
step_drafter() { run drafter 30 50 python3 -m benchmarks.drafter_bench --target $PWD/models/kestrel-tiny \
  --drafter $PWD/models/kestrel-tiny-eagle3 --prompts 8 --device cuda --out $O/drafter_cur.json; }
step_fp8_online() { bench fp8_online --quantization fp8; }
step_fp8_channel() { BENCH_MAX=140 bench fp8_channel --fp8-checkpoint channel; }
step_fp8_gemm_tests() { run tests_fp8_gemm 20 60 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short \
  tests/gpu/test_fp8_gpu.py -k "block_gemm or engine"; }
step_mla_tests() { run tests_mla 30 100 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short \
  tests/gpu/test_moe_gpu.py -k "mla or deepseek or dummy"; }
step_mla() { run mla 60 120 python3 -m benchmarks.moe_bench --shape deepseek-v3-small --out $O/moe_deepseek.json; }
# ORDER: the steps to run, in order (a step that does not fit in what is left is skipped). Not in the default:
# fp8_channel (a compressed-tensors per-channel checkpoint), fp8_gemm_tests (the block GEMM and the engine's FP8
# tokens alone), mla_tests + mla (DeepSeek-V3-small: latent attention's GPU tests, its bs1 and 128 concurrent)
for s in ${ORDER:-fp8_tests bf16 fp8_block fp8_gemv moe moe_tests spec_tests drafter fp8_online}; do step_$s; done
st table
python3 - $O <<'EOF' | tee -a $O/steps.txt
import json, sys, pathlib
o = pathlib.Path(sys.argv[1])
print("| 8B shape | bs1 tok/s | c128 tok/s | TTFT ms | load GB/s | startup s |")
print("|---|---:|---:|---:|---:|---:|")
for name in ("bf16", "base_bf16", "fp8_block", "fp8_channel", "fp8_online"):
    try:
        m = json.loads((o / f"{name}.json").read_text())["models"]["llama-3.1-8b"]
        (road, v), = m["kestrel"].items()
        print(f"| {name} ({road}) | {v['bs1']['decode_tok_s']:.1f} | {v['c128']['output_tok_s']:.0f} | "
              f"{m['ttft_128_ms']:.2f} | {m.get('load_gb_s', 0):.2f} | {m['startup_s']:.1f} |")
    except FileNotFoundError:
        print(f"| {name} | not run |")
    except Exception as exc:   # noqa: BLE001 - a failed row says why
        print(f"| {name} | {type(exc).__name__}: {str(exc)[:80]} |")
EOF
tar czf $OUT/call3.tgz -C $O .
