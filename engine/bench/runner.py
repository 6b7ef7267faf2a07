"""Runs the variants interleaved (repeat r of every variant before repeat r+1), one process per run, the
order turned by one each round (A-B, B-A; A-B-C, B-C-A, C-A-B): no variant always runs first after the
bandwidth probe. That slot was measured to matter: the same tree read 1.7-2.5x faster prefill and ~20%
lower TTFT in the first slot than in the second (count300_en, 2026-11-30).

Between runs it sleeps `idle_gap_s` (lets the CPU cool and other load settle). A variant with `busy=True`
runs while a busy-loop process is pinned to core 0: the "another process holds a core" case in which
numba's OpenMP threads once collapsed to ~1 tok/s. `cold=True` gives the run empty numba/tokenizer caches.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Sequence

from .variants import Run, Variant, Workload
from .worker import RESULT_TAG

REPO_ROOT = Path(__file__).resolve().parents[2]
BUSY_CODE = ("import os, sys\n"
             "try:\n    os.sched_setaffinity(0, {int(sys.argv[1])})\nexcept (AttributeError, OSError):\n    pass\n"
             "x = 0\nwhile True:\n    x += 1\n")


def start_busy_process(core: int = 0) -> subprocess.Popen:
    """A process spinning on `core` (pinned with sched_setaffinity where available)."""
    return subprocess.Popen([sys.executable, "-c", BUSY_CODE, str(core)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def stop_process(p: subprocess.Popen | None) -> None:
    if p is None or p.poll() is not None:
        return
    p.terminate()
    try:
        p.wait(timeout=5)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait(timeout=5)


def variant_root(v: Variant) -> Path:
    """The checkout a variant's worker runs from: its tree= (another checkout of ninfer-chat), else this one."""
    return Path(v.tree).expanduser().resolve() if v.tree else REPO_ROOT


def worker_env(v: Variant, cold_dir: str | None) -> dict:
    """Environment of one worker: thread counts for numba/OpenMP/BLAS; a fresh cache dir for cold runs; its
    checkout first on the import path. A variant of another checkout (tree=) does not inherit this
    process's NUMBA_CACHE_DIR: that directory is keyed on this checkout's kernel sources (numba_env), and
    numba checks a cached function against its own file only, so a tree whose step.py had not
    changed since an earlier run in that directory loaded the fused step compiled with its old kernels
    (2026-12-03: a worktree moved from 93e7d13 to d527754 decoded 93e7d13's text). Its own numba_env keys
    its own directory under the same root."""
    env = dict(os.environ)
    n = str(v.threads)
    env.update(NUMBA_NUM_THREADS=n, OMP_NUM_THREADS=n, OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env["PYTHONPATH"] = str(variant_root(v)) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(v.env)
    if cold_dir:
        env["NINFER_CACHE_DIR"] = cold_dir
    if cold_dir or variant_root(v) != REPO_ROOT:
        env.pop("NUMBA_CACHE_DIR", None)
    return env


# ggml's AMX matmul (built in where the CPU that compiled llama-cpp-python has AMX) crashed every llama.cpp run
# on a Xeon guest with AMX (SIGSEGV in ggml_backend_amx_mul_mat, 2026-12-02); a build without it runs
AMX_OFF = ("CMAKE_ARGS='-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON "
           "-DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON' "
           ".venv/bin/python -m pip install --no-cache-dir --force-reinstall --no-deps llama-cpp-python")


def exit_reason(returncode: int, kind: str) -> str:
    """Why a worker ended: its exit status, or the signal that killed it, with what to do when the peer's
    native code crashed."""
    if returncode >= 0:
        return f"worker exited {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    why = f"worker killed by {name}"
    if kind == "llama.cpp" and name in ("SIGSEGV", "SIGILL", "SIGBUS"):
        why += f" (llama-cpp-python crashed in its native code; on a CPU with AMX rebuild it without: {AMX_OFF})"
    return why


def run_one(run: Run, timeout_s: float = 900.0) -> dict:
    """Spawn the worker for one run; return its result dict (ok=False with the error on failure)."""
    v = run.variant
    cold_dir = tempfile.mkdtemp(prefix="ninfer-bench-cold-") if v.cold else None
    busy = start_busy_process(0) if v.busy else None
    try:
        if busy is not None:
            time.sleep(0.3)  # let the spinner take its core
        env = worker_env(v, cold_dir)
        env["NINFER_BENCH_T0"] = repr(time.time())
        proc = subprocess.run([sys.executable, "-m", "engine.bench.worker"], input=run.to_json(), text=True,
                              capture_output=True, env=env, cwd=str(variant_root(v)), timeout=timeout_s)
        for line in reversed(proc.stdout.splitlines()):
            if line.startswith(RESULT_TAG):
                return json.loads(line[len(RESULT_TAG):])
        return {"ok": False, "variant": v.name, "repeat": run.repeat,
                "error": f"{exit_reason(proc.returncode, v.kind)} without a result: {proc.stderr.strip()[-800:]}"}
    except subprocess.TimeoutExpired:
        return {"ok": False, "variant": v.name, "repeat": run.repeat, "error": f"timed out after {timeout_s:.0f} s"}
    finally:
        stop_process(busy)
        if cold_dir:
            shutil.rmtree(cold_dir, ignore_errors=True)


def run_bench(variants: list[Variant], workload: Workload, model: str, repeats: int = 2, idle_gap_s: float = 2.0,
              max_context: int = 2048, log: Callable[[str], None] = print, warmup: bool = True,
              bandwidth: Callable[[], float] | None = None) -> list[dict]:
    """All runs, interleaved: for r in repeats: for v in the variants turned by r. A first unmeasured pass
    per variant populates the on-disk caches (unless `warmup` is False or the variant is cold), the fused
    step compiled in its own process (NINFER_COMPILE_BG=0), so that no compile helper outlives it.

    `bandwidth` (bytes/s), when given, is measured before every round and after the last: each run's
    "read_bandwidth" is the mean of the two that bracket its round, so its share of the roofline compares
    it with the memory speed of the same minutes (the host's moves by tens of percent between minutes)."""
    results = []
    if warmup:
        _byte_compile(log, trees=sorted({variant_root(v) for v in variants if v.kind == "ours"}))
        for v in variants:
            if v.cold or v.kind != "ours":
                continue
            log(f"[warm-up] {v.name}: populating caches (not measured)")
            short = replace(workload, decode_tokens=min(4, workload.decode_tokens), thinking_budget=None)
            # the fused step compiled in the warm-up's own process: on an empty cache a compile helper would
            # go on compiling it for minutes after the warm-up ends, beside the measured runs
            fg = replace(v, busy=False, env={**v.env, "NINFER_COMPILE_BG": "0"})
            run = Run(fg, short, model, repeat=-1, max_context=max_context)
            res = run_one(run)
            if not res.get("ok"):
                log(f"[warm-up] {v.name} failed: {res.get('error')}")
    bw_before = _probe(bandwidth, log)
    for r in range(repeats):
        this_round = []
        k = r % len(variants)
        for v in variants[k:] + variants[:k]:
            run = Run(v, workload, model, repeat=r, max_context=max_context)
            res = run_one(run)
            this_round.append(res)
            log(_one_line(res))
            if idle_gap_s > 0:
                time.sleep(idle_gap_s)
        bw_after = _probe(bandwidth, log)
        for res in this_round:
            if bw_before and bw_after:
                res["read_bandwidth"] = (bw_before + bw_after) / 2
        results += this_round
        bw_before = bw_after
    return results


def _byte_compile(log: Callable[[str], None], packages: tuple[str, ...] = ("engine", "ninfer_tui"),
                  trees: Sequence[Path] = ()) -> None:
    """Write the bytecode of our packages, as a warm start of an installed copy has it (and of the same
    packages in the variants' other checkouts, `trees`). Where PYTHONDONTWRITEBYTECODE is set (this
    project's dev machines), imports never write it, and every run compiled the engine's modules from source
    (~0.1 s of its TTFT). Read-only installs are left as they are."""
    import compileall
    import importlib.util
    dirs = []
    for pkg in packages:
        spec = importlib.util.find_spec(pkg)
        if spec and spec.submodule_search_locations:
            dirs += list(spec.submodule_search_locations)
        dirs += [str(t / pkg) for t in trees if t != REPO_ROOT and (t / pkg).is_dir()]
    for d in dirs:
        if not compileall.compile_dir(d, quiet=2):
            log(f"[warm-up] could not write the bytecode of {d} (read-only?): runs compile it from source")


def _probe(bandwidth: Callable[[], float] | None, log: Callable[[str], None]) -> float | None:
    if bandwidth is None:
        return None
    bw = bandwidth()
    log(f"[bandwidth] {bw / 1e9:.1f} GB/s read")
    return bw


def _one_line(res: dict) -> str:
    name = f"{res.get('variant')}#{res.get('repeat')}"
    if not res.get("ok"):
        return f"[run] {name}: FAILED {res.get('error')}"
    parts = [f"decode {res.get('decode_tok_s') or 0:.1f} tok/s"]
    if res.get("prefill_tok_s"):
        parts.append(f"prefill {res['prefill_tok_s']:.1f} tok/s")
    if res.get("ttft_s") is not None:
        parts.append(f"ttft {res['ttft_s']:.2f} s")
    parts.append(f"rss {res.get('peak_rss', 0) / 2**20:.0f} MB")
    return f"[run] {name}: " + ", ".join(parts)
