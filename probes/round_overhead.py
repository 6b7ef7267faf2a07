"""What a decode round costs outside the fused step, and the CPU share the contention guard reads.

    PYTHONPATH=. .venv/bin/python probes/round_overhead.py [--tokens 128] [--reps 4] [--busy]

Prints, for greedy replies to the count300_en workload (the product loop, Session.generate, one token per
round: NINFER_DECODE_BLOCK=1 unless set, since a decode block chooses its tokens inside one call):
  round       1000 / decode tok/s of the reply
  step        FusedForward.run (the jitted step and its guard)
  copy        from the step's return to Model.forward's (the logits copy)
  choose      TokenChooser.choose (greedy: argmax)
  rest        from choose's return to the next step (detokenizer, stop strings, events, the next checks)
Then the cost of calling into numba with the fused step's ~70 array arguments (a no-op function of the same
arguments), hot and after streaming 100 MB (the cache state after a decode step), and with --busy the
process's CPU seconds per wall second of one-token steps on 2 and 1 threads, quiet and with a spinner
pinned to core 0 (what engine/backends/cpu/guard.py reads).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

os.environ.setdefault("NINFER_DECODE_BLOCK", "1")  # rounds of one token: what the marks below time
from engine import numba_env  # noqa: F401,E402  (flags before numba)

import numpy as np  # noqa: E402


def _n_arrays(x) -> int:
    """Arrays in a (nested) argument tuple."""
    if isinstance(x, tuple):
        return sum(_n_arrays(a) for a in x)
    return int(isinstance(x, np.ndarray))


def _rounds(eng, msgs, tokens: int, reps: int) -> None:
    from engine import sampling
    from engine.config import GenerateRequest, SamplingParams
    from engine.events import FinalStats
    ff, model = eng.model.step, eng.model
    marks = {"run_start": [], "run_end": [], "fwd_end": [], "choose_end": []}

    def wrap(obj, name, before=None, after=None):
        orig = getattr(obj, name)

        def f(*a, **k):
            if before:
                marks[before].append(time.perf_counter())
            r = orig(*a, **k)
            marks[after].append(time.perf_counter())
            return r
        setattr(obj, name, f)
    wrap(ff, "run", "run_start", "run_end")
    wrap(model, "forward", None, "fwd_end")
    orig_choose = sampling.TokenChooser.choose

    def choose(self, row):
        r = orig_choose(self, row)
        marks["choose_end"].append(time.perf_counter())
        return r
    sampling.TokenChooser.choose = choose
    try:
        for rep in range(reps):
            for v in marks.values():
                v.clear()
            sp = SamplingParams(greedy=True, temperature=0.0, max_new=tokens)
            fs = None
            for ev in eng.session().generate(msgs, GenerateRequest(sampling=sp)):
                if isinstance(ev, FinalStats):
                    fs = ev
            rs, re_, fe, ce = (np.asarray(marks[k]) for k in ("run_start", "run_end", "fwd_end", "choose_end"))
            m = min(len(ce), len(rs) - 1) - 1  # decode rounds: forward i+1 is followed by choose i
            us = lambda a: f"{1e6 * np.median(a):6.0f}"  # noqa: E731
            print(f"reply {rep}: round {1e3 / fs.decode_tok_s:.3f} ms | step {us(re_[1:m + 1] - rs[1:m + 1])} us"
                  f" | copy {us(fe[1:m + 1] - re_[1:m + 1])} | choose {us(ce[:m] - fe[1:m + 1])}"
                  f" | rest {us(rs[2:m + 2] - ce[:m])} us (medians)")
    finally:
        sampling.TokenChooser.choose = orig_choose


def _call_cost(eng) -> None:
    import numba
    from numba import njit
    ff = eng.model.step
    cache = eng.session().cache
    args = ff.call_args(np.array([5], np.int32), 1, 1, ff.kv_tuple(cache), ff._attn_scratch(cache.capacity),
                        numba.get_num_threads())

    @njit(nogil=True)
    def noop(*a):
        return 0

    @njit(nogil=True)
    def noop3(a, b, c):
        return 0
    small = (ff.bufs[0], 1, 2)
    noop(*args)
    noop3(*small)
    junk = np.ones(100_000_000 // 8)
    for label, f, a in ((f"{_n_arrays(args)} arrays", noop, args), ("3 arguments", noop3, small)):
        hot, cold = [], []
        for _ in range(200):
            t = time.perf_counter()
            f(*a)
            hot.append(time.perf_counter() - t)
        for _ in range(50):
            junk.sum()
            t = time.perf_counter()
            f(*a)
            cold.append(time.perf_counter() - t)
        print(f"call with {label}: {1e6 * np.median(hot):.1f} us hot, {1e6 * np.median(cold):.1f} us after "
              "streaming 100 MB")


def _cpu_share(eng) -> None:
    import numba

    from engine.bench.runner import start_busy_process, stop_process
    ff, model = eng.model.step, eng.model
    ff.guard.before = ff.guard.after = lambda: None
    cache = model.new_cache(256)
    model.forward(np.arange(1, 61, dtype=np.int32), 0, cache)
    for label in ("quiet", "core 0 busy"):
        p = start_busy_process(0) if label != "quiet" else None
        time.sleep(0.5)
        try:
            for nt in (2, 1):
                numba.set_num_threads(nt)
                ts, share = [], []
                for _ in range(60):
                    c, t = time.process_time(), time.perf_counter()
                    model.forward(np.array([7], np.int32), 60, cache)
                    dt = time.perf_counter() - t
                    ts.append(dt)
                    share.append((time.process_time() - c) / dt)
                    cache.truncate(60)
                p10, p50, p90 = np.percentile(share, [10, 50, 90])
                print(f"{label}, {nt} thread(s): step {1e3 * np.median(ts):.1f} ms, CPU s per wall s "
                      f"p10/p50/p90 {p10:.2f}/{p50:.2f}/{p90:.2f}")
        finally:
            stop_process(p)
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--busy", action="store_true", help="also the CPU share quiet and with a busy core")
    a = ap.parse_args()
    from engine.api import Engine
    from engine.bench.variants import read_messages_file, workload_file
    from engine.config import EngineArgs
    eng = Engine.load(EngineArgs(threads=2, prefix_reuse=False))
    if eng.model.step is None or not hasattr(eng.model.step, "roles"):
        print("needs the fused step (run once to fill the numba cache first)", file=sys.stderr)
        return 1
    _rounds(eng, read_messages_file(workload_file("count300_en")), a.tokens, a.reps)
    _call_cost(eng)
    if a.busy:
        _cpu_share(eng)
    return 0


if __name__ == "__main__":
    sys.exit(main())
