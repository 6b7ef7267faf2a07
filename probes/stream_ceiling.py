"""How close the decode step can come to the roofline: the probe's reader, the step's matmul kernels alone,
and the whole step, alternated in one process over the same minutes.

    PYTHONPATH=. .venv/bin/python probes/stream_ceiling.py [--rounds 8] [--reps 60] [--ctx 60]

Four ways of reading the model's weights on two threads, each timed from the threads' common start to the
last one's end, in turn (the order turns each repetition):
  reader      engine/bench's prefetching reader (stream_sum) over 2 x 128 MiB, as ninfer-bench's probe;
  kernels     the decode step's matmul kernels (cpu_fast._q4 / _q8) over every layer's seven matrices and
              the head, each thread its half of every matrix's row groups (the step's items), in the step's
              order, with no barrier, no serial tail and no attention: the most the step's structure could
              reach with these kernels, on the weights as loaded (cpu_fast.prepare_layers: one region per
              thread);
  role-major  the same over copies laid out one array per role, each layer's groups in order (the layout
              before prepare_layers: each thread jumps over the other's half at every matrix);
  step        the fused decode step itself: blocks of 8 tokens in one call (FusedForward.block) at
              positions ctx .. ctx + 39, the guard off; its rate per token;
  step-role-major  the same step on the role-major copies (FusedForward.roles swapped around the call).
Printed per round (reps repetitions each): GB/s of each (the weights' bytes over the time; the reader its
own bytes) as median and best, and the ratios that bound the roofline share: kernels / reader (the
kernels' streaming), step / kernels (what the step's barriers, tails and attention cost), step / reader
(the share itself, against the median and against the best-of-5 the benchmark's probe takes).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("NUMBA_NUM_THREADS", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine import numba_env  # noqa: E402,F401  (flags before numba)

import numpy as np  # noqa: E402
from numba import njit, prange  # noqa: E402

from engine.bench.stream_read import stream_sum  # noqa: E402
from engine.backends.cpu.avx2 import PREFETCH, XS  # noqa: E402
from engine.backends.cpu.fast import _q4, _q8, quantize_rows  # noqa: E402
from engine.backends.cpu.step import BLOCK  # noqa: E402


@njit(nogil=True, inline="always")
def _half(tid, nt, out, qa, sa, xs, w, l):
    # thread tid's share of one matrix's groups, in the fused step's item order (part by part)
    h = w[0].shape[2]
    n = h * w[0].shape[1]
    for i in range(tid * n // nt, (tid + 1) * n // nt):
        _q4(out, qa, sa, xs, w[0][l, i // h], w[1][i], i % h, i)


@njit(nogil=True)
def _thread(tid, nt, acts, outs, wq, wk, wv, wo, wg, wu, wd, head):
    qa, sa, xs, qa2, sa2, xs2 = acts
    o1, o2, o3, logits = outs
    for l in range(wq[0].shape[0]):
        _half(tid, nt, o1, qa, sa, xs, wq, l)
        _half(tid, nt, o2, qa, sa, xs, wk, l)
        _half(tid, nt, o2, qa, sa, xs, wv, l)
        _half(tid, nt, o1, qa, sa, xs, wo, l)
        _half(tid, nt, o3, qa, sa, xs, wg, l)
        _half(tid, nt, o3, qa, sa, xs, wu, l)
        _half(tid, nt, o1, qa2, sa2, xs2, wd, l)
    n = head[2].shape[0]
    for g in range(tid * n // nt, (tid + 1) * n // nt):
        _q8(logits, qa, sa, head[2], head[4][g], g)


@njit(nogil=True, parallel=True)
def kernels_pass(acts, out0, out1, wq, wk, wv, wo, wg, wu, wd, head):
    for tid in prange(2):
        _thread(np.int64(tid), np.int64(2), acts, out0 if tid == 0 else out1, wq, wk, wv, wo, wg, wu, wd, head)


@njit(nogil=True, parallel=True)
def reader_pass(a, b, ahead):
    s = np.zeros(2)
    for tid in prange(2):
        s[tid] = stream_sum(a if tid == 0 else b, ahead)
    return s.sum()


def role_major(ws):
    """Copies of the role stacks as one array per role, each layer's groups in order (L, 1, ng, nb, BLK4):
    the layout before cpu_fast.prepare_layers."""
    return tuple((np.ascontiguousarray(w[0].reshape(w[0].shape[0], 1, -1, *w[0].shape[3:])), w[1]) for w in ws)


def _acts(n, rng):
    x = rng.standard_normal((1, n)).astype(np.float32)
    qa, sa, xs = np.zeros((1, n), np.int8), np.zeros((1, n // 32), np.float32), np.zeros((1, XS * (n // 32)), np.float32)
    quantize_rows(qa, sa, xs, x)
    return qa, sa, xs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--ctx", type=int, default=60)
    a = ap.parse_args()
    import numba

    from fused_engine import load_fused
    loaded = load_fused(q8_head=True)
    if loaded is None:
        return 2
    eng, model, ff = loaded
    numba.set_num_threads(2)
    r = ff.roles
    ws = tuple(r[k] for k in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"))
    wbytes = sum(w[0].nbytes for w in ws) + ff.head[2].nbytes
    rws = role_major(ws)
    rng = np.random.default_rng(0)
    d, f = ff.args.d_model, ff.args.d_ff
    acts = _acts(d, rng) + _acts(f, rng)
    rows = max(ff.args.q_dim, d, f)
    outs = tuple((np.zeros((1, rows), np.float32), np.zeros((1, rows), np.float32), np.zeros((1, rows), np.float32),
                  np.zeros((1, ff.head[2].shape[0] * 32), np.float32)) for _ in range(2))
    ra, rb = (np.arange((128 << 20) // 8, dtype=np.float64) + i for i in range(2))
    cache = model.new_cache(a.ctx + 64)
    model.forward(np.arange(1, a.ctx + 1, dtype=np.int32) % 1000 + 100, 0, cache)
    ff.guard.before = lambda: None
    ff.guard.after = lambda steps=1: None
    pos = [a.ctx]

    roles = {"step": ff.roles, "step-role-major": dict(zip(ff.roles, rws))}
    toks = {}

    def step(name):  # a decode block of BLOCK tokens (one call), as a reply decodes
        ff.roles = roles[name]
        cache.length = pos[0]
        toks.setdefault(pos[0], {})[name] = ff.block(5, pos[0], cache, BLOCK, frozenset())
        if len(toks[pos[0]]) == 2:
            pos[0] = a.ctx + (pos[0] - a.ctx + BLOCK) % 40

    runs = {"reader": lambda: reader_pass(ra, rb, PREFETCH),
            "kernels": lambda: kernels_pass(acts, outs[0], outs[1], *ws, ff.head),
            "role-major": lambda: kernels_pass(acts, outs[0], outs[1], *rws, ff.head),
            "step": lambda: step("step"),
            "step-role-major": lambda: step("step-role-major")}
    nbytes = {"reader": ra.nbytes + rb.nbytes, "kernels": wbytes, "role-major": wbytes, "step": wbytes * BLOCK,
              "step-role-major": wbytes * BLOCK}
    t = time.perf_counter()
    for fn in runs.values():
        fn()
    print(f"compiled in {time.perf_counter() - t:.0f} s; weights {wbytes / 1e6:.1f} MB per token", flush=True)
    names = list(runs)
    print("round  GB/s median (best): " + " / ".join(names) + ";  kernels/reader  step/kernels  "
          "step/reader (step vs the reader's best of 5)")
    allr = {k: [] for k in names}
    for rd in range(a.rounds):
        rate = {k: [] for k in names}
        for i in range(a.reps):
            for k in (names if i % 2 == 0 else names[::-1]):
                t = time.perf_counter()
                runs[k]()
                rate[k].append(nbytes[k] / (time.perf_counter() - t) / 1e9)
        med = {k: float(np.median(v)) for k, v in rate.items()}
        best = {k: max(v) for k, v in rate.items()}
        best5 = float(np.mean([max(rate["reader"][i:i + 5]) for i in range(0, a.reps, 5)]))
        for k in names:
            allr[k] += rate[k]
        print(f"{rd:5d}  " + " / ".join(f"{med[k]:5.1f} ({best[k]:5.1f})" for k in names)
              + f";  {med['kernels'] / med['reader']:5.2f}  {med['step'] / med['kernels']:5.2f}"
              f"  {med['step'] / med['reader']:5.2f} ({med['step'] / best5:4.2f})", flush=True)
    same = sum(len(set(map(tuple, v.values()))) == 1 for v in toks.values())
    print(f"the two steps chose the same tokens at {same} of {len(toks)} positions")
    med = {k: float(np.median(v)) for k, v in allr.items()}
    print("all    " + " / ".join(f"{med[k]:5.1f}" for k in names)
          + f";  {med['kernels'] / med['reader']:5.2f}  {med['step'] / med['kernels']:5.2f}"
          f"  {med['step'] / med['reader']:5.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
