#!/usr/bin/env bash
# Wheels the GPU machine lacks (it has torch/triton/transformers but no fastapi/uvicorn/pydantic/flashinfer and no
# network), downloaded here for its Python 3.12 into .whl/ (git-ignored); gpu_suite.sh installs them there. Carry
# the folder with the device call: carry [".whl"].
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python3}
dl() { $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "$@"; }
# The server stack (versions as in requirements/cpu.txt, plus what fastapi 0.165 needs beside them).
dl fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.14.4 pydantic-core==2.50.5 \
   annotated-types==0.8.0 typing-inspection==0.4.5 annotated-doc==0.0.7 opentelemetry-api==1.45.2 \
   typing-extensions==4.16.0 importlib-metadata==10.2.0 zipp==4.1.2
# Structured outputs (kestrel/structured; benchmarks/structured_bench.py): xgrammar (its tvm-ffi binding is below).
dl xgrammar==0.2.9
# GGUF parsing (SmolLM2; kestrel/models/gguf), pure Python.
dl gguf==0.19.0
# FlashInfer 0.5.2: the newest whose wheel fits the 64 MiB the device call carries; it JIT-compiles with nvcc there.
dl flashinfer-python==0.5.2 apache-tvm-ffi==0.1.15.post2 nvidia-cudnn-frontend==1.32.0
du -sh .whl
