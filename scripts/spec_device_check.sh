#!/usr/bin/env bash
# Speculative decoding on the device machine, one prepared run (~3-5 minutes):
#   1. verify-pass cost T=1,2,4,8 on the cuda backend (random SmolLM2-135M-shaped model: the real file is too
#      large to travel; same shapes and quant types, so the same bytes moved and the same speed);
#   2. lossless on the cuda backend: greedy off == ngram k=1,3,5 on the tiny models + verify-row vs step diff;
#   3./4. the same verify-pass cost on the cpu backend and the fused cpu_fast forward with 2 threads (a quiet
#      machine, unlike the shared dev box).
#   run(command="bash scripts/spec_device_check.sh", carry=[".whl"], timeout_s=480)
# .whl holds gguf (and numba-cuda, platformdirs) wheels for python 3.12, see scripts/gpu_check.sh.
set -u
cd "$(dirname "$0")/.."
RES=${OUT:-/tmp/spec_device_out}
mkdir -p "$RES"
exec > >(tee "$RES/spec_device_check.log") 2>&1
export PYTHONUNBUFFERED=1 NINFER_CUDA_REAL=1
unset NUMBA_ENABLE_CUDASIM
PY=${PYTHON:-python3}
SITE=/tmp/ninfer-site
mkdir -p "$SITE"
for pkg in gguf platformdirs; do
  "$PY" -c "import $pkg" 2>/dev/null || "$PY" -m pip install -q --no-index --no-deps --no-compile \
    --target "$SITE" .whl/$pkg-*.whl
done
if ! "$PY" -c "import importlib.metadata as m, sys; v = tuple(int(x) for x in m.version('numba-cuda').split('.')[:3]); sys.exit(v < (0, 30, 4))"; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/numba_cuda-*.whl
fi
# numpy >= 2.5 dropped np.row_stack, which numba-cuda's array typing still registers: alias it for this run
printf 'import numpy\nif not hasattr(numpy, "row_stack"):\n    numpy.row_stack = numpy.vstack\n' > "$SITE/sitecustomize.py"
export PYTHONPATH="$SITE:$PWD"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
"$PY" -c "import numba, numpy; print('numba', numba.__version__, 'numpy', numpy.__version__)"
echo "== 1. verify cost, cuda"
timeout 150 "$PY" -m engine.bench.speculative --random-smollm2 --backend cuda --json "$RES/verify_cuda.json"; echo "rc=$?"
echo "== 2. lossless, cuda, tiny models"
timeout 120 "$PY" -m engine.bench.speculative --lossless-tiny --backend cuda; echo "rc=$?"
echo "== 3. verify cost, cpu, 2 threads"
NUMBA_NUM_THREADS=2 timeout 75 "$PY" -m engine.bench.speculative --random-smollm2 --backend cpu --threads 2 \
  --json "$RES/verify_cpu2.json"; echo "rc=$?"
echo "== 4. verify cost, cpu_fast (fused forward), 2 threads"
NUMBA_NUM_THREADS=2 timeout 90 "$PY" -m engine.bench.speculative --random-smollm2 --backend cpu_fast --threads 2 \
  --json "$RES/verify_cpufast2.json"; echo "rc=$?"
echo "== done"
