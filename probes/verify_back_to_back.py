"""A verify pass's cost against a decode step when each size runs back to back (as decode steps do), and
interleaved with the other sizes (as `ninfer-bench speculative --verify-only` times them).

    PYTHONPATH=. .venv/bin/python probes/verify_back_to_back.py [--ctx 200] [--repeats 30]

The interleaved T=1 step runs after a pass of another size, which on an AVX-512 Xeon (2026-12-06) cost it
~1-1.5 ms more than a step after a step (4.0 against 2.7 ms), so the benchmark's ratios read lower than the
ones a decode loop would see; this prints both. One process, the default model, its runner, medians.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("NUMBA_NUM_THREADS", "2")

import numpy as np  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ctx", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 8])
    a = ap.parse_args()
    from engine.api import Engine
    from engine.config import EngineArgs
    m = Engine.load(EngineArgs(max_context=a.ctx + 64)).model
    rng = np.random.default_rng(0)
    cache = m.new_cache(a.ctx + 32, "f16")
    m.forward(rng.integers(10, 1000, a.ctx).astype(np.int32), 0, cache)

    def one(t: int) -> float:
        toks = rng.integers(10, 1000, t).astype(np.int32)
        t0 = time.perf_counter()
        m.forward(toks, a.ctx, cache, all_logits=True)
        dt = time.perf_counter() - t0
        cache.truncate(a.ctx)
        return dt * 1e3
    for t in a.sizes:  # warm-up: each batch shape once
        one(t)
    other = max(a.sizes)
    for mode in ("back to back", "interleaved"):
        res = {}
        for t in a.sizes:
            times = []
            for _ in range(a.repeats):
                if mode == "interleaved":
                    one(other if t != other else 1)
                times.append(one(t))
            res[t] = statistics.median(times)
        ratios = "  ".join(f"T={t} {res[t]:.2f} ms = {res[t] / res[a.sizes[0]]:.2f}x" for t in a.sizes)
        print(f"{mode:13s} {ratios}")


if __name__ == "__main__":
    main()
