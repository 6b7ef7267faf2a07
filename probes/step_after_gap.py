"""A decode step's cost after other work: right after a step, after a verify pass, after 8 ms of something else.

    PYTHONPATH=. .venv/bin/python probes/step_after_gap.py [--gap-ms 8] [--reps 3]

Times one-token passes of the default model at position 200 (median of 22 per case, each case --reps times):
back to back; each after a T=8 pass; each after gap-ms of the drafter-sized Q8_0 matmuls (8 x 576 -> 8192, both
threads), of a Python loop, of sleep. On the 2-core Xeon VM a step right after a step took 3.1-3.8 ms and one
after any 8 ms without the target's weights 4.8-5.0 (bench/results-verify.md, "A decode step timed as decode
runs them"): the weights stay in the shared L3 between steps ~3 ms apart, not ~8.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gap-ms", type=float, default=8.0)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    import numpy as np

    from engine.api import Engine
    from engine.config import EngineArgs
    from engine.spec.mtp import _draft_kernels, _q8
    eng = Engine.load(EngineArgs(threads=2, prefix_reuse=False, max_context=2048))
    m = eng.model
    cache = m.new_cache(600, "f16")
    rng = np.random.default_rng(0)
    m.forward(rng.integers(10, 1000, 200).astype(np.int32), 0, cache)
    be = _draft_kernels()
    w = be.prepare_weight(_q8("w", rng.standard_normal((8192, 576)).astype(np.float32) * 0.05))
    x, out = rng.standard_normal((8, 576)).astype(np.float32), np.zeros((8, 8192), np.float32)
    sc = be.new_scratch(8, 576)

    def until(ms, body):
        end = time.perf_counter() + ms / 1e3
        while time.perf_counter() < end:
            body()

    def t8(ms):
        m.forward(rng.integers(10, 1000, 8).astype(np.int32), 200, cache, all_logits=True)
        cache.truncate(200)
    cases = {"back to back": None, "after a T=8 pass": t8,
             f"after {a.gap_ms:g} ms of Q8_0 matmuls": lambda ms: until(ms, lambda: be.matmul(out, x, w, sc)),
             f"after {a.gap_ms:g} ms of Python": lambda ms: until(ms, lambda: None),
             f"after {a.gap_ms:g} ms of sleep": lambda ms: time.sleep(ms / 1e3)}
    res: dict[str, list[float]] = {}
    for _ in range(a.reps):
        for name, before in cases.items():
            ts = []
            for _ in range(25):
                if before:
                    before(a.gap_ms)
                t0 = time.perf_counter()
                m.forward(rng.integers(10, 1000, 1).astype(np.int32), 200, cache)
                ts.append(time.perf_counter() - t0)
                cache.truncate(200)
            res.setdefault(name, []).append(1e3 * statistics.median(ts[3:]))
    for name, v in res.items():
        print(f"one-token step {name:34s}", " ".join(f"{x:.3f}" for x in v), "ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
