#!/usr/bin/env bash
# GPU evidence for the cuda backend, in one run of under 8 minutes on one GPU (sm_70 V100 or sm_90 H100/H200).
#
#   bash scripts/gpu_check.sh          # from the repo root, on the GPU machine
#
# On this project's device tool (no network there; the image has numba, numba-cuda, cuda-core, numpy, pytest;
# gguf comes as a carried wheel, see below):
#   run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=560)
# Wheels, made once on the dev machine (`.whl/` is listed in .git/info/exclude):
#   python -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl gguf==0.19.0 numba-cuda==0.30.4
#
# The environment set-up (python, the carried wheels) is scripts/device_env.sh, shared with device_model.sh.
# Steps (each under its own timeout; a failing step is reported and the next one still runs):
#   1. environment: GPU, driver, python, numba / numba-cuda / cuda-core versions (carried wheels fill gaps)
#   2. every kernel vs kernels/ref.py on the real device (tests/engine/test_cuda_kernels.py --worker)
#   3. tiny models end to end == ref greedy tokens, plain and CUDA-graph decode (test_cuda_model.py --worker)
#   4. TP2 with both ranks on GPU 0, transports p2p and mapped == TP1 (test_tp.py --worker)
#   5. decode benchmark of the default model (ninfer-bench gpu: engine/bench/gpu.py): tok/s, launches/token, graphs on/off
# Then ONE summary block. Work files: /tmp/gpu_check_work; copied to $OUT when set: summary.txt,
# gpu_check.log, kernels/model/tp.json, bench_full.json, env.txt (7 files).
set -u
cd "$(dirname "$0")/.."
RES=/tmp/gpu_check_work  # everything; $OUT (the device tool brings back 8 files) gets the key ones at the end
rm -rf "$RES"
mkdir -p "$RES"
exec > >(tee "$RES/gpu_check.log") 2>&1
export PYTHONUNBUFFERED=1 NUMBA_NUM_THREADS=${NUMBA_NUM_THREADS:-8} NINFER_CUDA_REAL=1
# GPU_CHECK_DRY=1: rehearse the whole script on a machine without a GPU, under the CUDA simulator (slow; pass
# GPU_CHECK_BENCH_ARGS="--model tiny.gguf --tokens 2 --prompt 3 --no-tp" to keep the bench small)
if [ "${GPU_CHECK_DRY:-0}" = 1 ]; then export NUMBA_ENABLE_CUDASIM=1; else unset NUMBA_ENABLE_CUDASIM; fi
BENCH_ARGS=${GPU_CHECK_BENCH_ARGS:---tokens 128 --prompt 64 --long 1024}
T0=$(date +%s)
say() { echo "[gpu_check +$(( $(date +%s) - T0 ))s] $*"; }

say "1/5 environment"
nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv,noheader \
  || [ "${GPU_CHECK_DRY:-0}" = 1 ] || { echo "gpu_check: nvidia-smi failed: no GPU here"; exit 2; }
. scripts/device_env.sh
"$PY" - <<'EOF' | tee "$RES/env.txt"
import importlib.metadata as m, platform
print("python", platform.python_version())
for p in ("numpy", "numba", "numba-cuda", "cuda-core", "cuda-bindings", "gguf"):
    try:
        print(p, m.version(p))
    except m.PackageNotFoundError:
        print(p, "MISSING")
from numba import cuda
print("cuda.is_available", cuda.is_available())
d = cuda.get_current_device()
print("device", getattr(d, "name", "?"), "cc", getattr(d, "compute_capability", "?"))
EOF
[ "${PIPESTATUS[0]}" = 0 ] || { echo "gpu_check: numba.cuda cannot start here; see above"; exit 3; }

run_step() {  # name timeout_s command...: JSON on the last stdout line goes to $RES/name.json
  local name=$1 to=$(( $2 * ${GPU_CHECK_TIMEOUT_SCALE:-1} )); shift 2
  say "$name"
  timeout "$to" "$@" > "$RES/$name.out" 2> "$RES/$name.err"
  local rc=$?
  tail -n 1 "$RES/$name.out" > "$RES/$name.json"
  [ $rc = 0 ] || { echo "  $name exited $rc (124 = timeout); stderr tail:"; tail -n 15 "$RES/$name.err"; }
}
run_step kernels 150 "$PY" tests/engine/test_cuda_kernels.py --worker
run_step model 150 "$PY" tests/engine/test_cuda_model.py --worker
run_step tp 120 "$PY" tests/engine/test_tp.py --worker
# shellcheck disable=SC2086
run_step bench 240 "$PY" -m engine.bench.gpu $BENCH_ARGS --json "$RES/bench_full.json"

say "summary"
"$PY" - "$RES" <<'EOF' | tee "$RES/summary.txt"
import json, pathlib, sys
res = pathlib.Path(sys.argv[1])
def load(n):
    try:
        return json.loads((res / f"{n}.json").read_text())
    except Exception as e:
        return {"_error": f"no result ({e.__class__.__name__})"}
print("=" * 30, "ninfer cuda gpu_check summary", "=" * 30)
print((res / "env.txt").read_text().strip().replace("\n", " | ") if (res / "env.txt").exists() else "env: ?")
for n in ("kernels", "model", "tp"):
    r = load(n)
    ok = [k for k, v in r.items() if v == "ok" or isinstance(v, dict)]
    bad = {k: v for k, v in r.items() if k not in ok}
    print(f"{n:8s}: {len(ok)}/{len(r)} passed" + ("" if not bad else "  FAILED: " + ", ".join(bad)))
    for k, v in bad.items():
        print(f"    {k}: {str(v).strip().splitlines()[-1][:300] if str(v).strip() else v}")
b = load("bench")
if "_error" in b:
    print("bench   :", b["_error"])
else:
    print("bench   : model:", b.get("model"))
    for k in ("plain", "fused", "graph", "graph_unfused", "graph_ctx1024", "vs_ref", "tp2_p2p", "tp2_mapped", "profile_one_step_us"):
        if k in b:
            print(f"  {k:10s}", json.dumps(b[k]))
print("=" * 91)
EOF
say "done"
if [ -n "${OUT:-}" ]; then
  cp "$RES"/summary.txt "$RES"/gpu_check.log "$RES"/kernels.json "$RES"/model.json "$RES"/tp.json \
     "$RES"/bench_full.json "$RES"/env.txt "$OUT"/ 2>/dev/null || true
fi
