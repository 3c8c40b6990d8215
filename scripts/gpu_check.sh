#!/bin/sh
# The whole GPU check (issues on framework state and performance), for a machine with a
# CUDA device, in a few minutes:
#   1. the GPU tests (pytest -m gpu: CuPy variables, cv.load(device="GPU:0"), CUDA torch
#      tensors saved and restored through the pinned staging buffer, host memory bounded);
#   2. benchmarks/gpu_save.py: 1 GiB of CUDA tensors saved by ckptvar (staged) against a
#      raw .cpu() + write + fsync, torch.save and safetensors, and loaded back onto the GPU
#      against safetensors' safe_open(device="cuda:0") and torch.load(map_location=);
#   3. the GPU loads against the limit: the raw file read to host and copied, the pinned
#      host->device copy, cv.load(path, device="GPU:0") for h5 and Zarr, and safetensors'
#      safe_open(..., device="cuda:0") (scripts/bench.py --only big,gpu).
# With HOST_ROWS=1, also the host rows of the 1 GiB model on this machine's CPUs.
# A machine without zarr (the lent GPU machines have torch, CuPy, h5py, msgpack and
# ml_dtypes, but no zarr) gets it from .whl/ (git-ignored), filled beforehand with
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     zarr numcodecs crc32c google-crc32c donfig
# Needs the gpu extra (pip install -e '.[gpu]'; CuPy) and torch with CUDA. Results go to
# $OUT (default bench-results/gpu). Usage: scripts/gpu_check.sh  (PYTHON=... picks the
# interpreter; a folder .whl/ of wheels, if present, is installed to /tmp/site first).

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
OUT="${OUT:-$ROOT/bench-results/gpu}"
mkdir -p "$OUT"
cd "$ROOT" || exit 2
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 2
    export PYTHONPATH="$ROOT:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
status=0
"$PYTHON" -c "import cupy; n = cupy.cuda.runtime.getDeviceCount(); print(n, 'CUDA device(s):', cupy.cuda.runtime.getDeviceProperties(0)['name'].decode())" \
    || { echo "no CUDA device or no CuPy: nothing to check"; exit 3; }
nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv \
    > "$OUT/nvidia-smi.csv" 2>&1
df -h "$OUT" >> "$OUT/nvidia-smi.csv" 2>&1
echo "== 1. pytest -m gpu"
timeout 220 "$PYTHON" -m pytest -q -n 0 -m gpu -p no:cacheprovider -W ignore::DeprecationWarning \
    tests/test_device.py tests/test_io.py tests/test_checkpoint.py tests/test_frameworks.py \
    tests/test_staging.py 2>&1 | tee "$OUT/pytest-gpu.txt" | tail -25 || status=1
echo "== 2. GPU saves and loads (benchmarks/gpu_save.py)"
timeout 150 "$PYTHON" -m benchmarks.gpu_save --gib 1 --repeats 2 --dir "$OUT/save-data" \
    --json "$OUT/gpu-save.json" 2>&1 | tee "$OUT/gpu-save.txt" | tail -20 || status=1
rm -rf "$OUT/save-data"
echo "== 3. GPU loads against the limit (scripts/bench.py --only big,gpu)"
timeout 150 "$PYTHON" scripts/bench.py --only big,gpu \
    --subjects raw,ckptvar-h5,ckptvar-zarr,safetensors --ops gpu_h2d,gpu_warm,gpu_cold,load_warm,load_cold \
    --repeats 2 --peer-repeats 2 --json "$OUT/bench-gpu.json" --md "$OUT/bench-gpu.md" --png "" \
    --dir "$OUT/data" > "$OUT/bench-gpu.log" 2>&1 || status=1
rm -rf "$OUT/data"
grep -i "gpu" "$OUT/bench-gpu.md" | head -20 || tail -20 "$OUT/bench-gpu.log"
if [ -n "$HOST_ROWS" ]; then
    echo "== 4. the host rows on this machine's CPUs (save durable and not, load, restore)"
    timeout 150 "$PYTHON" scripts/bench.py --only big \
        --subjects "raw,ckptvar-h5,ckptvar-zarr,ckptvar-h5 nd,ckptvar-zarr nd" \
        --ops save,load_warm,load_cold,restore_warm,restore_cold \
        --repeats 2 --json "$OUT/bench-host.json" --md "$OUT/bench-host.md" --png "" \
        --dir "$OUT/data" > "$OUT/bench-host.log" 2>&1 || status=1
    rm -rf "$OUT/data"
    sed -n '/## Summary/,/^## ~1 GiB/p' "$OUT/bench-host.md" | head -20
fi
exit $status
