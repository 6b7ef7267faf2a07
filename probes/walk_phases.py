"""Where a decode step of the plain walk goes (engine.model's kernel-by-kernel forward: what a model with
K-quant / Q5 matrices runs): every backend call timed by kind, and the weights' stream rate inside the
matmul calls.

    PYTHONPATH=. .venv/bin/python probes/walk_phases.py FILE.gguf [--ctx 1024] [--tokens 16]

The prompt (ctx tokens of one repeated id; the cache is what matters, not the text) is prefilled untimed,
then `tokens` greedy steps are decoded twice: once plain (the step's ms), once with each backend method
wrapped by a timer (probe_timers.time_calls; the wrappers add ~1 us a call). Printed: ms per step, each
kind's ms per step and share, and the matmuls' GB/s over the bytes their weights hold.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict

os.environ.setdefault("NUMBA_NUM_THREADS", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

from engine import numba_env  # noqa: E402,F401  (flags before numba)
from kquant_bench import kernel_bytes  # noqa: E402  (the bytes a prepared weight's layout holds)
from probe_timers import time_calls  # noqa: E402

from engine.backends.kernels import KERNELS  # noqa: E402


def decode(model, cache, tok: int, pos: int, n: int) -> float:
    t0 = time.perf_counter()
    for i in range(n):
        logits = model.forward(np.array([tok], np.int32), pos + i, cache)
        tok = int(np.argmax(logits[-1]))
    return (time.perf_counter() - t0) / n


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=16)
    a = ap.parse_args()
    from engine.backends.cpu import build_model
    from engine.gguf import load_gguf
    model = build_model(load_gguf(a.model), 64)
    be = model.be
    cache = model.new_cache(a.ctx + 2 * a.tokens + 8)
    for p0 in range(0, a.ctx, 64):  # prefill in chunks of 64
        model.forward(np.full(min(64, a.ctx - p0), 100, np.int32), p0, cache)
    decode(model, cache, 100, a.ctx, 2)  # warm
    plain = decode(model, cache, 100, a.ctx + 2, a.tokens)
    cache.truncate(a.ctx + 2)
    totals = defaultdict(float)
    for k in KERNELS:
        if k != "matmul" and hasattr(be, k):
            time_calls(be, k, totals, k)
    by_type = defaultdict(lambda: [0.0, 0])  # weight type -> [seconds, bytes its layout holds]
    plain_matmul = be.matmul

    def matmul(out, x, w, scratch):
        t0 = time.perf_counter()
        try:
            return plain_matmul(out, x, w, scratch)
        finally:
            kind = getattr(w, "qtype", None) or getattr(w, "kind", None) or type(w).__name__
            rec = by_type[str(getattr(kind, "name", kind))]
            rec[0] += time.perf_counter() - t0
            rec[1] += kernel_bytes(w)
    be.matmul = matmul
    timed = decode(model, cache, 100, a.ctx + 2, a.tokens)
    totals["matmul"] = sum(sec for sec, _ in by_type.values())
    wbytes = sum(nbytes for _, nbytes in by_type.values()) / a.tokens
    print(f"{os.path.basename(a.model)}: ctx {a.ctx}, {a.tokens} steps; plain {plain * 1e3:.2f} ms a step, timed "
          f"{timed * 1e3:.2f}")
    for k in sorted(totals, key=lambda k: -totals[k]):
        ms = totals[k] / a.tokens * 1e3
        print(f"  {k:>16} {ms:8.2f} ms  {totals[k] / a.tokens / timed:6.1%}")
    print(f"  {'other':>16} {(timed - sum(totals.values()) / a.tokens) * 1e3:8.2f} ms")
    print(f"  matmuls stream {wbytes / (totals['matmul'] / a.tokens) / 1e9:.1f} GB/s ({wbytes / 1e6:.0f} MB of "
          "weights a step)")
    for kind, (sec, nbytes) in sorted(by_type.items(), key=lambda kv: -kv[1][0]):
        print(f"    {kind:>12} {sec / a.tokens * 1e3:8.2f} ms  {nbytes / a.tokens / 1e6:7.0f} MB  "
              f"{nbytes / sec / 1e9:5.1f} GB/s")


if __name__ == "__main__":
    main()
