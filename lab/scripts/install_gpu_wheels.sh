# Sourced by the GPU scripts: install the wheels carried in .whl/ (lab/scripts/fetch_gpu_wheels.sh) and .whl-lite/ (the
# server stack alone, when a call's 64 MiB must also carry something big) into /tmp/site, and put it on PYTHONPATH.
for dir in .whl .whl-lite; do
  if ls "$dir"/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$dir"/*.whl >/dev/null 2>&1
  fi
done
export PYTHONPATH=$PWD:/tmp/site NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
