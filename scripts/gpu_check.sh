#!/bin/sh
# The whole GPU check (issue 25, goal 6), for the first machine that has a CUDA device:
#   1. the GPU tests (pytest -m gpu: CuPy variables, cv.load(device="GPU:0"), restores);
#   2. the GPU loads against the limit: the raw file read to host and copied, the pinned
#      host->device copy, cv.load(path, device="GPU:0") for h5 and Zarr, and safetensors'
#      safe_open(..., device="cuda:0") when torch has CUDA (scripts/bench.py --only big,gpu).
# A few minutes in all. Needs the gpu extra (pip install -e '.[gpu]'; CuPy) and, for the
# safetensors row, torch with CUDA. Results go to $OUT (default bench-results/gpu).
# Usage: scripts/gpu_check.sh        (PYTHON=... picks the interpreter)

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${PYTHON:-python}"
OUT="${OUT:-$ROOT/bench-results/gpu}"
mkdir -p "$OUT"
cd "$ROOT" || exit 2
status=0
"$PYTHON" -c "import cupy; n = cupy.cuda.runtime.getDeviceCount(); print(n, 'CUDA device(s):', cupy.cuda.runtime.getDeviceProperties(0)['name'].decode())" \
    || { echo "no CUDA device or no CuPy: nothing to check"; exit 3; }
nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv \
    > "$OUT/nvidia-smi.csv" 2>&1
timeout 240 "$PYTHON" -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tee "$OUT/pytest-gpu.txt" \
    | tail -5 || status=1
timeout 300 "$PYTHON" scripts/bench.py --only big,gpu \
    --subjects raw,ckptvar-h5,ckptvar-zarr,safetensors --ops gpu_h2d,gpu_warm,gpu_cold,load_warm,load_cold \
    --repeats 2 --peer-repeats 2 --json "$OUT/bench-gpu.json" --md "$OUT/bench-gpu.md" --png "" \
    --dir "$OUT/data" > "$OUT/bench-gpu.log" 2>&1 || status=1
rm -rf "$OUT/data"
grep -A40 "## Goals" "$OUT/bench-gpu.md" | grep -i "gpu" || tail -20 "$OUT/bench-gpu.log"
exit $status
