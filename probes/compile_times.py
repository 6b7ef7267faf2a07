"""How long numba takes to compile the fused CPU step from an empty cache, function by function.

    PYTHONPATH=. .venv/bin/python probes/compile_times.py [--kv f16|int8] [--top 20]

Runs with a fresh numba cache (a temporary NINFER_CACHE_DIR, removed at the end) and no compile helper, on a
tiny llama model written by make_tiny_models with SmolLM2's weight types (the compile depends on the types,
not the sizes), and times the first pass, which compiles the fused step. Then, per jitted function and
signature: seconds under numba's compiler lock (nested: a function's figure includes the callees it
compiled) and under LLVM's lock, and per function the number of signatures it was compiled for. A function
compiled for two signatures that differ only in integer types (prange's index, a literal argument) is a
whole compile paid twice. This compile is most of a cold CI run's time and of the wait before a cold start
switches to the fused step.
"""
from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv", choices=("f16", "int8"), default="f16", help="the KV cache's type")
    ap.add_argument("--top", type=int, default=20, help="rows to print")
    ap.add_argument("--passes", type=int, default=0, metavar="N",
                    help="also LLVM's N slowest passes of each of the 3 slowest functions (NUMBA_LLVM_PASS_TIMINGS)")
    args = ap.parse_args()
    if args.passes:
        os.environ["NUMBA_LLVM_PASS_TIMINGS"] = "1"
    tmp = tempfile.mkdtemp(prefix="ninfer-compile-times-")
    os.environ["NINFER_CACHE_DIR"] = tmp
    os.environ["NINFER_COMPILE_BG"] = "0"
    os.environ.pop("NUMBA_CACHE_DIR", None)
    sys.path[:0] = [ROOT, os.path.join(ROOT, "tests", "fixtures")]  # make_tiny_models
    try:
        run(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run(args, tmp: str) -> None:
    from engine import numba_env  # noqa: F401  (flags before numba)

    import numpy as np
    from gguf import GGMLQuantizationType as QT
    from make_tiny_models import make_tiny_model
    from numba.core.registry import CPUDispatcher
    from numba.core import types

    from engine.backends.kernels import Kernels
    from engine.gguf import load_gguf
    from engine.backends.cpu import fast as cpu_fast
    from engine.backends.cpu.step import build
    from engine.model import Model

    roles = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up")
    q4 = dict(token_embd=QT.Q8_0, **{r: QT.Q4_1 for r in roles}, ffn_down=[QT.Q4_1])  # as SmolLM2's file
    mf = load_gguf(make_tiny_model(os.path.join(tmp, "tiny-llama.gguf"), "llama", seed=0, qtypes=q4))
    model = Model(mf.args, mf.tensors, Kernels("cpu", cpu_fast), max_batch=8)
    fused = build(model)
    if fused is None:
        raise SystemExit("this model does not run the fused step (its weights' types)")
    cache = model.new_cache(32, args.kv)
    t0 = time.perf_counter()
    fused(np.array([3, 17, 42], np.int32), 0, cache)
    print(f"first pass (the fused step's compile, {args.kv} KV cache): {time.perf_counter() - t0:.1f} s")

    rows, sigs = [], {}
    for d in gc.get_objects():
        if isinstance(d, CPUDispatcher):
            name = f"{d.py_func.__module__}.{d.py_func.__qualname__}"
            for sig, cres in d.overloads.items():
                timers = (cres.metadata or {}).get("timers", {})
                rows.append((timers.get("compiler_lock", 0.0), timers.get("llvm_lock", 0.0), name,
                             (cres.metadata or {}).get("llvm_pass_timings")))
                sigs.setdefault(name, []).append(sig)
    rows.sort(key=lambda r: r[:3], reverse=True)
    print(f"{'compile s':>10} {'llvm s':>8}  function (nested: callees included)")
    for c, l, name, _ in rows[:args.top]:
        print(f"{c:10.1f} {l:8.1f}  {name}")
    for c, l, name, passes in rows[:3] if args.passes else ():
        if passes is not None:
            print(f"\nLLVM passes of {name} (own, not its callees'):")
            print(passes.summary(topn=args.passes))
    print(f"{len(rows)} compiled signatures of {len(sigs)} functions")
    for name, ss in sorted(sigs.items()):
        arrays = [tuple(t for t in s if not isinstance(t, types.Integer)) for s in ss]
        if len(set(arrays)) < len(arrays):
            print(f"compiled again for other integer types only: {name} ({len(ss)} signatures)")


if __name__ == "__main__":
    main()
