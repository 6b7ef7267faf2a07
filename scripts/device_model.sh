#!/usr/bin/env bash
# The real default model (SmolLM2-135M-Instruct Q4_1, 98 MB) on the device machine, which cannot download it
# and takes at most 64 MiB a call with the working tree (~21 MB): the file travels in three parts, one per
# call, made back to back (the machine keeps /tmp only while it stays warm, ~30 s after a call).
#
# Here, once (both ignored by git):
#   .venv/bin/python -m engine.bench.real_model split      # .devmodel/part1..3 + .devmodel/manifest.json
#   .venv/bin/python -m pip download ... -d .whl gguf==0.19.0 numba-cuda==0.30.4 platformdirs   (gpu_check.sh)
# bench/gpu_expected.json (committed) holds the prompts' ids and the cpu / reference greedy replies
# (`python -m engine.bench.real_model expected`; again only when the model file changes).
#
# Then, through the device tool, without a pause between the calls:
#   run(command="bash scripts/device_model.sh stage 1", carry=[".devmodel/part1", ".devmodel/manifest.json"], timeout_s=60)
#   run(command="bash scripts/device_model.sh stage 2", carry=[".devmodel/part2"], timeout_s=60)
#   run(command="bash scripts/device_model.sh run", carry=[".devmodel/part3", ".whl"], timeout_s=560)
#   run(command="bash scripts/device_model.sh run spec", carry=[".whl"], timeout_s=200)   # while still warm
# `run [STEP...]` joins the parts (sha256 checked against the manifest; once there, the file stays in /tmp while
# the machine is warm) and runs the steps (default: check bench ncu), each under its own timeout:
#   check: greedy replies of the cuda backend's runner (fused kernels, one CUDA graph per step), of the plain
#      kernel walk, and of TP2 (both ranks on GPU 0) against the cpu and reference records
#      (engine/bench/real_model.py check: where a reply first differs and the reference's margin there);
#   bench: ninfer-bench gpu on the real file: tok/s plain / fused / graph, launches per token, the one-step profile;
#   ncu: GPU time per kernel of one decode step (Nsight Compute; plain launches of the fused kernels);
#   spec: speculative rounds on the real file (engine/bench/speculative.py --backend cuda: plain, n-gram, MTP3,
#      DFlash7 with the committed drafters, which the file's sha256 selects; verify-pass cost T = 1..8).
# Results: $OUT/{summary.txt, device_model.log, check_*.json, bench_gpu.json, ncu_summary.json, spec_cuda.json}.
set -u
cd "$(dirname "$0")/.."
STORE=/tmp/ninfer_model
mkdir -p "$STORE"
case "${1:-}" in
  stage)
    n=${2:?"stage N: which part (1, 2, 3)"}
    [ -f ".devmodel/part$n" ] || { echo "device_model: .devmodel/part$n did not travel: name it in carry"; exit 2; }
    cp ".devmodel/part$n" "$STORE/" && { [ ! -f .devmodel/manifest.json ] || cp .devmodel/manifest.json "$STORE/"; }
    ls -la "$STORE"
    exit 0 ;;
  run) ;;
  *) echo "usage: bash scripts/device_model.sh stage N | run"; exit 2 ;;
esac

RES=${OUT:-/tmp/device_model_out}
mkdir -p "$RES"
exec > >(tee "$RES/device_model.log") 2>&1
export PYTHONUNBUFFERED=1 NINFER_CUDA_REAL=1
T0=$(date +%s)
say() { echo "[device_model +$(( $(date +%s) - T0 ))s] $*"; }
[ ! -f .devmodel/part3 ] || cp .devmodel/part3 "$STORE/"
MODEL=$STORE/model.gguf
nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap,clocks.sm,clocks.max.sm --format=csv,noheader
. scripts/device_env.sh
if [ ! -f "$MODEL" ]; then
  say "join"
  "$PY" -m engine.bench.real_model join --parts-dir "$STORE" --manifest "$STORE/manifest.json" --out "$MODEL" \
    || exit 3
fi

step() {  # name timeout_s command...
  local name=$1 to=$2; shift 2
  say "$name"
  timeout "$to" "$@"; local rc=$?
  [ $rc = 0 ] || echo "  $name exited $rc (124 = timeout)"
}
STEPS=${*:2}
STEPS=${STEPS:-check bench ncu}
for s in $STEPS; do
  case $s in
    check)
      step check_graph 120 "$PY" -m engine.bench.real_model check --model "$MODEL" --backend cuda \
        --json "$RES/check_graph.json"
      step check_plain 60 "$PY" -m engine.bench.real_model check --model "$MODEL" --backend cuda --plain \
        --json "$RES/check_plain.json"
      step check_tp2 90 "$PY" -m engine.bench.real_model check --model "$MODEL" --backend cuda --tp 2 \
        --json "$RES/check_tp2.json" ;;
    bench)
      step bench_gpu 120 "$PY" -m engine.bench.gpu --model "$MODEL" --tokens 128 --prompt 64 --no-tp \
        --json "$RES/bench_gpu.json" ;;
    ncu)  # GPU time of each kernel of one decode step (plain launches of the fused kernels)
      if command -v ncu >/dev/null; then
        step ncu 120 ncu --profile-from-start off --csv --metrics gpu__time_duration.sum \
          "$PY" -m engine.bench.real_model profile --model "$MODEL" > "$RES/ncu.csv"
        "$PY" -m engine.bench.real_model ncu-summary "$RES/ncu.csv" --json "$RES/ncu_summary.json" | cut -c1-2000
      else
        echo "ncu: not on this machine"
      fi ;;
    spec)
      step spec_cuda 150 "$PY" -m engine.bench.speculative --model "$MODEL" --backend cuda --variants off ngram:3 \
        mtp:3:hot dflash:7:hot --workloads count300_plain_en.json count300_en.json --chats 2 --repeats 1 \
        --json "$RES/spec_cuda.json" ;;
    *) echo "device_model: unknown step $s (check, bench, ncu, spec)" ;;
  esac
done

say "summary"
"$PY" - "$RES" <<'EOF' | tee "$RES/summary.txt"
import json, pathlib, sys
res = pathlib.Path(sys.argv[1])
print("=" * 30, "ninfer real model on the device", "=" * 30)
for n in ("check_graph", "check_plain", "check_tp2"):
    f = res / f"{n}.json"
    if not f.exists():
        print(f"{n}: no result"); continue
    r = json.loads(f.read_text())
    print(f"{n}: {r['runner']} tp {r['tp']}: same as ref {r['same_as_ref']}/{r['n_prompts']}, same as cpu "
          f"{r['same_as_cpu']}/{r['n_prompts']}, {r['tok_s_incl_prefill']} tok/s incl. prefill")
    for p in r["prompts"]:
        if not (p["same_as_ref"] and p["same_as_cpu"]):
            print("   ", json.dumps(p))
f = res / "bench_gpu.json"
if f.exists():
    b = json.loads(f.read_text())
    for k in ("model", "plain", "fused", "graph", "graph_unfused", "vs_ref", "profile_one_step_us"):
        print(f"  {k:10s}", json.dumps(b.get(k)))
f = res / "ncu_summary.json"
if f.exists():
    n = json.loads(f.read_text())
    print(f"ncu: {n['us_per_step']} us of GPU time in one decode step, {n['launches_per_step']} kernels")
    for k, v in list(n["kernels"].items())[:12]:
        print(f"  {k:24s} {json.dumps(v)}")
f = res / "spec_cuda.json"
print("spec_cuda:", "written" if f.exists() else "not run or no result")
print("=" * 93)
EOF
say "done"
