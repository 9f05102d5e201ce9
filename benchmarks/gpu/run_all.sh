#!/usr/bin/env bash
# The whole GPU job in one command, on the lent H200 (through the `run` tool, from the repo root):
#   [WHEELS=dir] bash benchmarks/gpu/run_all.sh [--only SECTION ...]
# Maps the working tree onto the `deepserve` namespace (our package is not installed there), then
# runs run_all.py, which writes results.json / results.md and its log under $OUT.
set -uo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
ns=/tmp/deepserve-ns/deepserve
mkdir -p "$ns"
for root in engine kernels server kvcache router disagg; do ln -sfn "$repo/$root" "$ns/$root"; done
export PYTHONPATH=/tmp/deepserve-ns:$repo/tests${PYTHONPATH:+:$PYTHONPATH}
# The server's dependencies the device image lacks (fastapi, uvicorn, pydantic, deepseek-recipe...)
# travel as wheels: WHEELS=path/to/dir, fetched as benchmarks/gpu/wheels.txt says.
if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/deepserve-site "$WHEELS"/*.whl || exit 1
  export PYTHONPATH=/tmp/deepserve-site:$PYTHONPATH
fi
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/deepserve-gpu-out}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv | tee "$out/gpu.txt"
python3 "$repo/benchmarks/gpu/run_all.py" --out "$out" "$@" 2>&1 | tee "$out/log.txt"
