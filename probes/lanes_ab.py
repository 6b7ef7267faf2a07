"""A decode step in two lanes with two barriers per layer, against the fused step, in one process: the
measurement behind a design that was not adopted (bench/results-cpu-history.md, 2026-12-02 afternoon).

    PYTHONPATH=. .venv/bin/python probes/lanes_ab.py [--rounds 6] [--reps 40] [--ctx 60]

The fused step (engine/backends/cpu/step.py) has five phases per layer, each ending at a barrier with a
serial tail. Here lane p (of two; the threads claim lanes, so one thread alone runs both) keeps its own copy
of the residual row and does, per layer: (A) the norm, the q/k/v rows of its KV heads (the KV head both
lanes need is computed by both), rope, the KV store, attention of those heads, and o over its half of o's
columns (a partial sum); barrier; (B) both halves of o added, the norm, gate/up of its half of the FFN's
columns, swiglu, and down over its half of down's columns; barrier. The head is shared out as in the step.
o and down sum in two halves, so the bits are not the fused step's: it prints the largest logit difference
and how often the greedy choice agrees.

Timed in turn, one pass per call at positions ctx..ctx + 39 (medians per round):
  fused   FusedForward, one pass;
  lanes   the lanes on the step's weights (q/k/v and gate/up from prepare_layers' regions) with o's and
          down's column halves copied out per lane;
  contig  the lanes on one buffer per lane holding, layer by layer, everything that lane reads.
and the share of the lanes' cycles spent waiting at the A and B barriers and in the head (both threads).
Needs two threads and SmolLM2 (a Q8_0 head, KV heads that split as o's halves need).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("NUMBA_NUM_THREADS", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine import numba_env  # noqa: E402,F401

import numpy as np  # noqa: E402
from numba import njit, prange  # noqa: E402

from engine.backends.cpu import kernels as cpu  # noqa: E402
from engine.backends.cpu import attn as A  # noqa: E402
from engine.backends.cpu.attn import SPLITS, store_f16  # noqa: E402
from engine.backends.cpu.fast import _q4, _q8, quantize_rows  # noqa: E402
from engine.backends.cpu.step import _embed, swiglu_fast  # noqa: E402
from engine.backends.cpu.sync import finish, grab, new_sync, open_phase, reset_rows, wait_open  # noqa: E402
from fused_engine import cycles as _cyc  # noqa: E402

F32 = np.float32
WAITS = np.zeros((2, 4), np.int64)  # per thread: cycles waiting at A, B, head; cycles total


@njit(nogil=True, inline="always")
def _enter(p, st, halves, norm_w, eps):
    """Lane p's residual row += the two halves of the last partial sums (their sum first, as one matmul's
    output would be added), then the norm, quantized: the input of the lane's next matmuls."""
    X, XB, QA, SA, XS = st[0], st[1], st[9], st[10], st[11]
    d = X.shape[1]
    for i in range(d):
        X[p, i] += halves[0, i] + halves[1, i]
    cpu.rmsnorm(XB[p:p + 1], X[p:p + 1], norm_w, eps)
    qa, sa, xs = QA[p:p + 1, :d], SA[p:p + 1, :d // 32], XS[p:p + 1, :d // 32]
    quantize_rows(qa, sa, xs, XB[p:p + 1])
    return qa, sa, xs


@njit(nogil=True, inline="always")
def _attend(p, l, pos0, st, kv, sc, k0, k1, rope_p):
    """Rope, the KV store and attention of KV heads k0..k1 (and their query heads) of lane p, into its ATT."""
    Q, K, V, ATT, PART, CS = st[2], st[3], st[4], st[5], st[12], st[13]
    inv_freq, neox, n_head, n_kv, hd, scale = rope_p
    grp = n_head // n_kv
    q3 = Q[p].reshape(1, n_head, hd)[:, k0 * grp:k1 * grp]
    k3 = K[p].reshape(1, n_kv, hd)[:, k0:k1]
    cs = CS[p:p + 1]
    cpu.rope_apply(q3, cs, neox)
    cpu.rope_apply(k3, cs, neox)
    kc, vc = kv[0][l][:, k0:k1], kv[1][l][:, k0:k1]
    store_f16(kc, k3, pos0)
    store_f16(vc, V[p].reshape(1, n_kv, hd)[:, k0:k1], pos0)
    part = PART[p:p + 1, k0:k1]
    for c in range(SPLITS):
        A.attn_item_f16(part, sc, q3, kc, vc, c, pos0, scale)
    A.merge_parts(ATT[p].reshape(1, n_head, hd)[:, k0 * grp:k1 * grp], part)


@njit(nogil=True, inline="always")
def _quant_cols(p, st, src, lo_blk, n_blk):
    """Blocks lo_blk.. (n_blk of them) of lane p's row src quantized into the same columns of its QA."""
    QA, SA, XS = st[9], st[10], st[11]
    lo, hi = lo_blk * 32, (lo_blk + n_blk) * 32
    qa, sa, xs = QA[p:p + 1, lo:hi], SA[p:p + 1, lo_blk:lo_blk + n_blk], XS[p:p + 1, lo_blk:lo_blk + n_blk]
    quantize_rows(qa, sa, xs, src[p:p + 1, lo:hi])
    return qa, sa, xs


@njit(nogil=True)
def lane_a(p, l, tok, pos0, st, wq, wk, wv, woh, lw, kv, sc, plan, norms, rope_p, emb, acc):
    """Phase A of layer l for lane p: its q/k/v rows, attention of its heads, o over its half of o's columns
    into PO[p]. Weights from the step's stacks (lw None; o's halves woh) or from the lane's buffer lw."""
    X, Q, K, V, ATT, CS, PO, PD = st[0], st[2], st[3], st[4], st[5], st[13], st[14], st[15]
    n_head, n_kv, hd = rope_p[2], rope_p[3], rope_p[4]
    k0, k1 = plan[p, 0], plan[p, 1]
    grp = n_head // n_kv
    if l == 0:
        _embed(X[p:p + 1], tok, emb)
        cpu.rope_table(CS[p:p + 1], pos0, rope_p[0])
        PD[:] = 0.0  # the first _enter adds nothing
    qa, sa, xs = _enter(p, st, PD, norms[0][l], norms[3])
    gq0, nq = k0 * grp * hd // 32, (k1 - k0) * grp * hd // 32
    gk0, nk = k0 * hd // 32, (k1 - k0) * hd // 32
    if lw is None:
        h, hk = wq[0].shape[2], wk[0].shape[2]
        for g in range(gq0, gq0 + nq):
            _q4(Q[p:p + 1], qa, sa, xs, wq[0][l, g // h], acc[p], g % h, g)
        for g in range(gk0, gk0 + nk):
            _q4(K[p:p + 1], qa, sa, xs, wk[0][l, g // hk], acc[p], g % hk, g)
            _q4(V[p:p + 1], qa, sa, xs, wv[0][l, g // hk], acc[p], g % hk, g)
        wl = woh[l, p]
    else:
        wl = lw[p * 4][l]
        for i in range(nq):
            _q4(Q[p:p + 1], qa, sa, xs, wl, acc[p], i, gq0 + i)
        for i in range(nk):
            _q4(K[p:p + 1], qa, sa, xs, wl, acc[p], nq + i, gk0 + i)
        for i in range(nk):
            _q4(V[p:p + 1], qa, sa, xs, wl, acc[p], nq + nk + i, gk0 + i)
        wl = lw[p * 4 + 1][l]
    _attend(p, l, pos0, st, kv, sc, k0, k1, rope_p)
    c = wl.shape[1]
    qa, sa, xs = _quant_cols(p, st, ATT, p * c, c)
    for g in range(wl.shape[0]):
        _q4(PO[p:p + 1], qa, sa, xs, wl, acc[p], g, g)


@njit(nogil=True)
def lane_b(p, l, st, wg, wu, wdh, lw, norms, acc):
    """Phase B of layer l for lane p: gate/up of its half of the FFN's columns, swiglu, down over its half
    of down's columns into PD[p]. Weights as lane_a's."""
    GATE, UP, HB, PO, PD = st[6], st[7], st[8], st[14], st[15]
    qa, sa, xs = _enter(p, st, PO, norms[1][l], norms[3])
    if lw is None:
        h = wg[0].shape[2]
        for j in range(h):
            _q4(GATE[p:p + 1], qa, sa, xs, wg[0][l, p], acc[p], j, p * h + j)
        for j in range(h):
            _q4(UP[p:p + 1], qa, sa, xs, wu[0][l, p], acc[p], j, p * h + j)
        wl = wdh[l, p]
    else:
        wl = lw[p * 4 + 2][l]
        h = wl.shape[0] // 2
        for j in range(h):
            _q4(GATE[p:p + 1], qa, sa, xs, wl, acc[p], j, p * h + j)
        for j in range(h):
            _q4(UP[p:p + 1], qa, sa, xs, wl, acc[p], h + j, p * h + j)
        wl = lw[p * 4 + 3][l]
    lo, hi = p * h * 32, (p + 1) * h * 32
    swiglu_fast(HB[p:p + 1, lo:hi], GATE[p:p + 1, lo:hi], UP[p:p + 1, lo:hi])
    qa, sa, xs = _quant_cols(p, st, HB, p * h, h)
    for g in range(wl.shape[0]):
        _q4(PD[p:p + 1], qa, sa, xs, wl, acc[p], g, g)


@njit(nogil=True)
def head_part(tid, nt, sync, ph, st, fin_bufs, head, norms, logits):
    X, PD = st[0], st[15]
    XT, XBT, QAT, SAT, XST = fin_bufs
    d = X.shape[1]
    for i in range(d):
        XT[tid, i] = X[0, i]
        XT[tid, i] += PD[0, i] + PD[1, i]
    cpu.rmsnorm(XBT[tid:tid + 1], XT[tid:tid + 1], norms[2], norms[3])
    qa, sa, xs = QAT[tid:tid + 1], SAT[tid:tid + 1], XST[tid:tid + 1]
    quantize_rows(qa, sa, xs, XBT[tid:tid + 1])
    n = head[2].shape[0]
    k = 0
    fin = False
    while True:
        k, lo, hi = grab(sync, ph, tid, nt, n, k)
        if lo >= hi:
            break
        for g in range(lo, hi):
            _q8(logits, qa, sa, head[2], head[4][g], g)
        fin = finish(sync, ph, hi - lo, n)
    if fin:
        open_phase(sync, ph)
    wait_open(sync, ph)


@njit(nogil=True)
def lane_thread(tid, nt, sync, tok, pos0, st, fin_bufs, emb, head, norms, rope_p, wq, wk, wv, woh, wg, wu, wdh, kv,
                sbuf, plan, logits, lw, acc, waits):
    t0 = _cyc()
    n_layer = norms[0].shape[0]
    sc = sbuf[tid]
    for l in range(n_layer):
        for half in range(2):
            ph = 2 * l + half
            k = 0
            fin = False
            while True:
                k, lo, hi = grab(sync, ph, tid, nt, 2, k)
                if lo >= hi:
                    break
                for p in range(lo, hi):
                    if half == 0:
                        lane_a(p, l, tok, pos0, st, wq, wk, wv, woh, lw, kv, sc, plan, norms, rope_p, emb, acc)
                    else:
                        lane_b(p, l, st, wg, wu, wdh, lw, norms, acc)
                fin = finish(sync, ph, hi - lo, 2)
            if fin:
                open_phase(sync, ph)
            c0 = _cyc()
            wait_open(sync, ph)
            waits[tid, half] += _cyc() - c0
    c0 = _cyc()
    head_part(tid, nt, sync, 2 * n_layer, st, fin_bufs, head, norms, logits)
    waits[tid, 2] += _cyc() - c0
    waits[tid, 3] += _cyc() - t0


@njit(nogil=True, parallel=True)
def lane_forward(tok, pos0, st, fin_bufs, emb, head, norms, rope_p, wq, wk, wv, woh, wg, wu, wdh, kv, sbuf, plan,
                 logits, sync, nt, lw, acc, waits):
    reset_rows(sync, 2 * norms[0].shape[0] + 1)
    for tid in prange(nt):
        lane_thread(np.int64(tid), nt, sync, tok, pos0, st, fin_bufs, emb, head, norms, rope_p, wq, wk, wv, woh,
                    wg, wu, wdh, kv, sbuf, plan, logits, lw, acc, waits)


def halves(w):
    """(L, P, h, nb, BLK4) row parts -> per lane a contiguous (L, ng, nb/2, BLK4) copy of its column half,
    as one (L, 2, ng, nb/2, BLK4) array (lane-major)."""
    st = w[0]
    L, P, h, nb, B = st.shape
    full = st.reshape(L, P * h, nb, B)
    c = nb // 2
    out = np.empty((2, L, P * h, c, B), np.uint8)
    for p in range(2):
        out[p] = full[:, :, p * c:(p + 1) * c]
    return np.moveaxis(out, 0, 1)


def lane_buffers(r, plan, grp, hd):
    """Per lane one buffer, layer by layer: its q/k/v row groups, o's column half, gate's and up's parts,
    down's column half; views (qkv (L, n, nb, B), o (L, ng, c, B), gate/up (L, 2h, nb, B), down (L, ng, c2, B))."""
    full = {k: np.ascontiguousarray(v[0]).reshape(v[0].shape[0], -1, *v[0].shape[3:]) for k, v in r.items()}
    L = full["wq"].shape[0]
    out = []
    for p in range(2):
        k0, k1 = plan[p]
        qg = slice(k0 * grp * hd // 32, k1 * grp * hd // 32)
        kg = slice(k0 * hd // 32, k1 * hd // 32)
        qkv = np.concatenate([full["wq"][:, qg], full["wk"][:, kg], full["wv"][:, kg]], 1)
        co, cd = full["wo"].shape[2] // 2, full["w_down"].shape[2] // 2
        o = full["wo"][:, :, p * co:(p + 1) * co]
        h = full["w_gate"].shape[1] // 2
        gu = np.concatenate([full["w_gate"][:, p * h:(p + 1) * h], full["w_up"][:, p * h:(p + 1) * h]], 1)
        dn = full["w_down"][:, :, p * cd:(p + 1) * cd]
        parts = [np.ascontiguousarray(a) for a in (qkv, o, gu, dn)]
        per = sum(a[0].nbytes for a in parts)
        buf = np.empty(L * per, np.uint8)
        views, off = [], 0
        for a in parts:
            v = np.lib.stride_tricks.as_strided(buf[off:], a.shape, (per,) + a.strides[1:])
            v[...] = a
            views.append(v)
            off += a[0].nbytes
        out.append(tuple(views))
    return tuple(v for o in out for v in o)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--ctx", type=int, default=60)
    a = ap.parse_args()
    import numba

    from fused_engine import load_fused
    loaded = load_fused()
    if loaded is None:
        return 2
    eng, model, ff = loaded
    numba.set_num_threads(2)
    ar = ff.args
    r = ff.roles
    woh, wdh = halves(r["wo"]), halves(r["w_down"])
    n_head, n_kv, hd = ar.n_head, ar.n_kv_head, ar.head_dim
    grp = n_head // n_kv
    c = woh.shape[3] * 32
    # lane 0's heads cover o's columns 0..c, lane 1's c..; each lane takes whole KV heads (their query heads)
    plan = np.array([[0, -(-(-(-c // hd)) // grp)], [(c // hd) // grp, n_kv]], np.int64)
    if wdh.shape[3] != r["w_gate"][0].shape[2] or ff.head[0] != 1:
        print("needs down's column halves to match gate/up's parts and a Q8_0 head (SmolLM2)", file=sys.stderr)
        return 2
    print("plan (kv heads per lane):", plan.tolist())
    f = np.float32
    d, q, kvd, ff_ = ar.d_model, ar.q_dim, ar.kv_dim, ar.d_ff
    mx = max(d, q, ff_)
    st = (np.zeros((2, d), f), np.zeros((2, d), f), np.zeros((2, q), f), np.zeros((2, kvd), f), np.zeros((2, kvd), f),
          np.zeros((2, q), f), np.zeros((2, ff_), f), np.zeros((2, ff_), f), np.zeros((2, ff_), f),
          np.zeros((2, mx), np.int8), np.zeros((2, mx // 32), f), np.zeros((2, mx // 32), f),
          np.zeros((2, n_kv, SPLITS, grp, hd + 2), f), np.zeros((2, hd // 2, 2), np.float64), np.zeros((2, d), f),
          np.zeros((2, d), f))
    fin_bufs = (np.zeros((2, d), f), np.zeros((2, d), f), np.zeros((2, d), np.int8), np.zeros((2, d // 32), f),
                np.zeros((2, d // 32), f))
    logits = np.zeros((1, ar.vocab_size), f)
    sync = new_sync(2 * ar.n_layer + 2, 2)
    cache = model.new_cache(a.ctx + 64)
    model.forward(np.arange(1, a.ctx + 1, dtype=np.int32) % 1000 + 100, 0, cache)
    ff.guard.before = lambda: None
    ff.guard.after = lambda steps=1: None
    sbuf = ff._attn_scratch(cache.capacity)[0]
    kvt = ff.kv_tuple(cache)

    lw = lane_buffers(r, plan, grp, hd)
    acc = np.zeros((2, 32), np.int16)  # per lane (the generic 4-bit form's scratch)

    def lanes(tok, pos, contig=False):
        lane_forward(np.array([tok], np.int32), pos, st, fin_bufs, ff.emb, ff.head, ff.norms, ff.rope, r["wq"],
                     r["wk"], r["wv"], woh, r["w_gate"], r["w_up"], wdh, kvt, sbuf, plan, logits, sync, np.int64(2),
                     lw if contig else None, acc, WAITS)
        cache.length = pos + 1
        return logits[0]

    def fused(tok, pos):
        cache.length = pos
        return ff(np.array([tok], np.int32), pos, cache)[0]

    t = time.perf_counter()
    la = lanes(5, a.ctx).copy()
    print(f"compiled in {time.perf_counter() - t:.0f} s", flush=True)
    fu = fused(5, a.ctx).copy()
    print("max |diff| %.3g (logit range %.3g), argmax %d vs %d" % (np.abs(la - fu).max(), np.ptp(fu), la.argmax(),
                                                                    fu.argmax()))
    tok, pos, same, worst = 5, a.ctx, 0, 0.0  # 40 greedy steps, each pass run both ways
    for i in range(40):
        cache.length = pos
        x1 = fused(tok, pos).copy()
        cache.length = pos
        x2 = lanes(tok, pos).copy()
        same += int(x1.argmax() == x2.argmax())
        worst = max(worst, float(np.abs(x1 - x2).max()))
        tok, pos = int(x1.argmax()), pos + 1
    print(f"argmax equal in {same}/40 greedy steps; max |diff| over them {worst:.3g}")
    x3 = lanes(7, a.ctx, True).copy()
    cache.length = a.ctx
    x4 = lanes(7, a.ctx).copy()
    print("contig vs lanes max |diff|", np.abs(x3 - x4).max())
    runs = {"fused": fused, "lanes": lanes, "contig": lambda t, p: lanes(t, p, True)}
    for rd in range(a.rounds):
        ts = {k: [] for k in runs}
        for i in range(a.reps):
            for k in (list(runs) if i % 2 == 0 else list(runs)[::-1]):
                p = a.ctx + i % 40
                cache.length = p
                t = time.perf_counter()
                runs[k](7, p)
                ts[k].append(time.perf_counter() - t)
        m = {k: np.median(v) * 1e3 for k, v in ts.items()}
        w = WAITS / WAITS[:, 3:].sum() * 2
        print("  lanes' cycles per thread: waiting at A %s, at B %s, the head %s"
              % (w[:, 0].round(3), w[:, 1].round(3), w[:, 2].round(3)))
        WAITS[:] = 0
        print(f"round {rd}: " + ", ".join(f"{k} {v:.3f} ms ({v / m['fused'] - 1:+.1%})" for k, v in m.items()),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
