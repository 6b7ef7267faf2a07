"""How the host's memory reads ramp up after an idle spell: the bandwidth probe's passes, then decode steps.

    PYTHONPATH=. .venv/bin/python probes/memory_ramp.py [--reps 6] [--idle 0.2] [--passes 16] [--steps 24]

Prints, as medians over --reps rounds:
  probe   GB/s of each pass of ninfer-bench's second reader (engine/bench/stream_read.py: two threads, as many
          bytes as the model's weights), right after --idle seconds of sleep, and with no pause;
  steps   ms of each one-token fused decode step (FusedForward.run, 40.. positions), after: a sleep, both cores
          spinning in Python (busy, but reading no memory), a 20 ms and a 2 ms sleep, and no pause.
If the first passes and steps are slow after a pause that kept the cores busy too, the ramp is the memory
system's (the host's uncore or memory clocks), not the cores' idle states nor the engine's: ninfer-bench's
probe takes the best of its passes (the warm rate), and worker.RAMP_TOKENS leaves a reply's first tokens out
of the steady decode rate that is set against it.
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from engine import numba_env  # noqa: F401,E402  (flags before numba)

import numpy as np  # noqa: E402


def _spin(s: float) -> None:
    end = time.perf_counter() + s
    while time.perf_counter() < end:
        pass


def _spin_both(s: float) -> None:
    t = threading.Thread(target=_spin, args=(s,))
    t.start()
    _spin(s)
    t.join()


def probe(nbytes: int, idle: float, passes: int, reps: int) -> None:
    from engine.bench.bandwidth import prefetched_buffers, prefetched_passes
    bufs = prefetched_buffers(2, nbytes)
    total = sum(b.nbytes for b in bufs)

    def run(n):
        return [total / t / 1e9 for t in prefetched_passes(bufs, n)]
    run(passes)
    got = {f"after {idle:g} s idle": [], "no pause": []}
    for _ in range(reps):
        time.sleep(idle)
        got[f"after {idle:g} s idle"].append(run(passes))
        got["no pause"].append(run(passes))
    print(f"probe, GB/s per pass of {nbytes >> 20} MiB (two readers):")
    for k, v in got.items():
        print(f"  {k:18s}", " ".join(f"{x:5.1f}" for x in np.median(np.asarray(v), axis=0)))


def steps(idle: float, n: int, reps: int) -> None:
    from engine.api import Engine
    from engine.config import EngineArgs
    eng = Engine.load(EngineArgs(threads=2, prefix_reuse=False))
    ff, cache = eng.model.step, eng.session().cache
    toks = np.arange(100, 160, dtype=np.int32)
    ff.run(toks[:40], 0, cache, 1)

    def run():
        out = []
        for i in range(n):
            t = time.perf_counter()
            ff.run(toks[i % 8:i % 8 + 1], 40 + i, cache, 1)
            out.append(1e3 * (time.perf_counter() - t))
        return out
    pauses = {f"sleep {idle:g} s": lambda: time.sleep(idle), f"spin {idle:g} s": lambda: _spin_both(idle),
              "sleep 20 ms": lambda: time.sleep(0.02), "sleep 2 ms": lambda: time.sleep(0.002),
              "no pause": lambda: None}
    run()
    got = {k: [] for k in pauses}
    for _ in range(reps):
        for k, pause in pauses.items():
            pause()
            got[k].append(run())
    print("decode steps, ms each (one token, 40.. positions, 2 threads):")
    for k, v in got.items():
        print(f"  {k:18s}", " ".join(f"{x:5.2f}" for x in np.median(np.asarray(v), axis=0)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=6)
    p.add_argument("--idle", type=float, default=0.2)
    p.add_argument("--passes", type=int, default=16)
    p.add_argument("--steps", type=int, default=24)
    a = p.parse_args()
    from engine.bench.bandwidth import probe_bytes, weight_bytes_per_token
    from engine.paths import default_model_path
    probe(probe_bytes(weight_bytes_per_token(str(default_model_path()))["bytes"], 2), a.idle, a.passes, a.reps)
    steps(a.idle, a.steps, a.reps)


if __name__ == "__main__":
    main()
