#!/usr/bin/env bash
# One GPU session's checks (~8 minutes at most), each step guarded so that one failing
# step does not stop the others:
#   1. pytest -m gpu               (compiled kernels in bf16/fp16, and any other GPU test)
#   2. pytest tests/kernel_tests        (the float32 kernel tests, compiled on the GPU this time)
#   3. benchmarks/gpu_kernels.py       (paged decode attention bandwidth)
#   4. benchmarks/offline_throughput.py --device cuda --model-shape qwen3-0.6b --dtype bfloat16
# Needs only torch, triton and transformers (no network): the package is installed
# with --no-deps --no-build-isolation. Results go to ${OUT:-./gpu_results}.
#
#   bash benchmarks/gpu_check.sh            # from the repository root
set -u
cd "$(dirname "$0")/.."
OUT_DIR=${OUT:-./gpu_results}
PY=${PYTHON:-python3}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET

status=0
step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to $OUT_DIR/NAME.log
    local name=$1 limit=$2; shift 2
    echo "=== $name (limit ${limit}s): $*"
    local start=$SECONDS
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT_DIR/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "=== $name: exit $rc after $((SECONDS - start))s"
    echo "$name $rc $((SECONDS - start))" >> "$OUT_DIR/summary.txt"
    [ "$rc" -eq 0 ] || status=1
}

: > "$OUT_DIR/summary.txt"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
  $PY -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
} | tee "$OUT_DIR/env.txt"

$PY -m pip install -e . --no-deps --no-build-isolation -q 2>&1 | tail -3 \
    || echo "pip install -e . failed; relying on the checkout being importable from the repo root"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

step pytest_gpu        150 $PY -m pytest -m gpu tests -q -rs -p no:cacheprovider
step kernels_bench     150 $PY benchmarks/gpu_kernels.py --out "$OUT_DIR/kernels.json"
step offline_throughput 120 $PY benchmarks/offline_throughput.py --device cuda --model-shape qwen3-0.6b \
                              --dtype bfloat16 --out "$OUT_DIR/offline_throughput.json"
step pytest_kernels_compiled 60 $PY -m pytest tests/kernel_tests -m "not gpu" -q -x -p no:cacheprovider

echo "summary (step, exit status, seconds):"; cat "$OUT_DIR/summary.txt"
exit $status
