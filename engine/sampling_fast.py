"""Jitted pieces of the sampling chain (engine.sampling): the candidate set (and greedy's argmax) without a
vocabulary-sized sort, copy or temporary per token.

Why: at vocab 49152 the numpy chain (argpartition, copies, exp over the vocabulary, fancy-indexed penalties)
cost ~0.5 ms per token, ~8% of a 6 ms decode step. Here a token costs one read of the logits row (and of the
chooser's penalty row when penalties or bans are active).

Canonical candidate order: processed logit descending (the logit after penalties and bans, before
temperature), ties by the lower token id. Top-k therefore keeps the lowest ids among tokens tied at the k-th
value. Banned (-inf) and NaN logits are never candidates. The one exception to the order: with no truncation at
all (top_k off, top_p 1, min_p 0) the candidates are every allowed token in id order (no sort needed to draw).

Cold compile is what limits the shape: every @njit function costs ~0.2-0.8 s on a first start (empty cache),
so there are few of them, no numpy sort or allocation inside (np.argsort alone cost seconds), the two paths are
separate entry points (a start compiles only the one its settings use), greedy reuses `top_scan` (k = 1) and
the draw is `draw` (also inside a decode block: `block_choice`). `compile_plan` names what a setting will
compile, so a background helper can do it ahead.

Paths (`select`):
- top-k with k <= KMAX: one pass keeping a small sorted buffer; the pass is chunked so that a chunk whose values
  are all below the buffer's last value costs one vectorized compare-and-count;
- otherwise (top-k off or large): exp over the vocabulary into a per-chooser work row (also the exact
  normaliser top-p needs), then collect the tokens above a threshold that is widened (e^-1, e^-2, e^-4, ...
  of the top) until they hold the needed mass / count, and sort only those. Exact: the collected set is always
  an upper set of the canonical order.
Probabilities: z = v / float32(temperature) (float32), e = exp(z - max z) (float32; on the threshold path the
vectorizable attn.exp_fast, within ~2 ulp of libm's, and 0 below -87), p = e / sum(e) summed in float64;
top-p keeps the smallest prefix whose cumulative p reaches top_p (the crossing token kept); min-p keeps
p >= min_p * p_max. Both keep a prefix of the order, so the result is one renormalised prefix.
"""
from __future__ import annotations

import engine.numba_env  # noqa: F401  (numba flags / cache dir before numba loads)

from typing import NamedTuple

import numpy as np
from numba import njit

from .backends.cpu.kernels import max_lanes8
from .backends.cpu.attn import exp_fast

KMAX = 128  # above this the insertion buffer costs more than the threshold path
CHUNK = 64  # values checked per vectorized compare before any scalar work
_SLACK = 1.0 + 1e-9  # the collected mass must beat top_p by more than summation-order rounding


@njit(cache=True, inline="always")
def _lanes_max(x, pen, use_pen):
    """The largest x[i] - pen[i] (x[i] where pen is empty); a NaN never counts (-inf if all are).
    Eight interleaved compare-and-select lanes (cpu.max_lanes8, as cpu.argmax_row) in one vector: numba's
    loop, one running maximum, stayed scalar (~1 ns a value: 50 of select_wide's 133 us per token over
    49152)."""
    m0 = m1 = m2 = m3 = m4 = m5 = m6 = m7 = np.float32(-np.inf)
    n = x.shape[0]
    end8 = n - n % 8
    for i in range(0, end8, 8):
        a0 = x[i] - pen[i] if use_pen else x[i]
        a1 = x[i + 1] - pen[i + 1] if use_pen else x[i + 1]
        a2 = x[i + 2] - pen[i + 2] if use_pen else x[i + 2]
        a3 = x[i + 3] - pen[i + 3] if use_pen else x[i + 3]
        a4 = x[i + 4] - pen[i + 4] if use_pen else x[i + 4]
        a5 = x[i + 5] - pen[i + 5] if use_pen else x[i + 5]
        a6 = x[i + 6] - pen[i + 6] if use_pen else x[i + 6]
        a7 = x[i + 7] - pen[i + 7] if use_pen else x[i + 7]
        m0, m1, m2, m3, m4, m5, m6, m7 = max_lanes8(m0, m1, m2, m3, m4, m5, m6, m7, a0, a1, a2, a3, a4, a5, a6, a7)
    m = max(max(max(m0, m1), max(m2, m3)), max(max(m4, m5), max(m6, m7)))
    for i in range(end8, n):
        v = x[i] - pen[i] if use_pen else x[i]
        if v > m:
            m = v
    return m


@njit(cache=True)
def top_scan(x, pen, k, ids, vals):
    """x (V,) f32 logits, pen (V,) f32 subtracted when non-empty -> n <= k: ids (k,) i64 / vals (k,) f32 hold
    the n largest x - pen (> -inf), in canonical order (value descending, ties by lower id)."""
    if pen.shape[0] > 0:  # a literal per case: each scan's chunk test compiles without the other's branch
        return _top_scan(x, pen, k, ids, vals, True)
    return _top_scan(x, pen, k, ids, vals, False)


@njit(cache=True, inline="always")
def _top_scan(x, pen, k, ids, vals, use_pen):
    """top_scan. The whole chunks' test is a count over a constant CHUNK values, which LLVM vectorizes fully:
    chunks ending at min(base + CHUNK, V), or a test in the loop for the last one, kept it ~5x slower (35 ->
    7 us per token over 49152 values with a penalty row, 21 -> 6 without: the user preset's path)."""
    V = x.shape[0]
    whole = V - V % CHUNK
    n = 0
    thr = np.float32(-np.inf)
    for base in range(0, whole, CHUNK):
        c = 0
        for i in range(base, base + CHUNK):  # most chunks stop here
            c += (x[i] - pen[i] if use_pen else x[i]) > thr
        if c == 0:
            continue
        n, thr = _insert(x, pen, use_pen, base, base + CHUNK, k, ids, vals, n, thr)
    if whole < V:
        n, thr = _insert(x, pen, use_pen, whole, V, k, ids, vals, n, thr)
    return n


@njit(cache=True, inline="always")
def _insert(x, pen, use_pen, lo, hi, k, ids, vals, n, thr):
    """The values of lo..hi above thr into top_scan's sorted buffer of n (<= k) -> (n, thr)."""
    for i in range(lo, hi):
        v = (x[i] - pen[i] if use_pen else x[i])
        if not v > thr:  # strict: an equal value with a higher id ranks after; also drops NaN
            continue
        j = n if n < k else k - 1  # slot freed at the end (the last one is dropped when full)
        while j > 0 and vals[j - 1] < v:
            vals[j] = vals[j - 1]
            ids[j] = ids[j - 1]
            j -= 1
        vals[j] = v
        ids[j] = i
        if n < k:
            n += 1
        if n == k:
            thr = vals[k - 1]
    return n, thr


@njit(cache=True)
def _finish(vals, n, temperature, m, norm, top_p, min_p, p):
    """Sorted candidate values vals[:n] -> kept prefix length; p[:kept] their renormalised probabilities.
    m: max z; norm: sum of exp(z - m) over the distribution the probabilities are taken from."""
    t = np.float32(temperature)
    acc = 0.0
    keep = n
    for j in range(n):
        p[j] = np.float64(np.exp(vals[j] / t - m)) / norm
    if top_p < 1.0:
        for j in range(n):
            acc += p[j]
            if acc >= top_p:
                keep = j + 1
                break
    if min_p > 0.0:
        lim = min_p * p[0]
        for j in range(keep):
            if p[j] < lim:
                keep = j
                break
    s = 0.0
    for j in range(keep):
        s += p[j]
    for j in range(keep):
        p[j] /= s
    return keep


@njit(cache=True)
def _exp_row(x, pen, temperature, work):
    """work[i] = exp(z_i - max z) (0 for banned) -> (max z, vmax, sum in float64)."""
    V = x.shape[0]
    use_pen = pen.shape[0] > 0
    vmax = _lanes_max(x, pen, use_pen)
    t = np.float32(temperature)
    m = vmax / t
    if not np.isfinite(vmax):
        return m, vmax, 0.0
    _exp_fill(x, pen, use_pen, t, m, work)
    return m, vmax, _sum64(work[:V])


@njit(cache=True, inline="always")
def _exp_fill(x, pen, use_pen, t, m, work):
    """work[i] = exp(z_i - m) by the vectorizable exp (attn.exp_fast, ~2 ulp): libm's expf, one call per
    token, cost ~0.15 ms of the ~0.27 per token over 49152 (top-k off). 0 below -87 (where float32's exp
    is subnormal or 0), for banned (-inf) and NaN logits: never candidates."""
    lo = np.float32(-87.0)
    for i in range(x.shape[0]):
        d = (x[i] - pen[i] if use_pen else x[i]) / t - m
        e = exp_fast(max(d, lo))
        work[i] = e if d >= lo else np.float32(0.0)


@njit(cache=True, fastmath={"reassoc", "contract"})
def _sum64(a):
    """Sum of a (float32) in float64, vectorized (reassociated: the order moves only the float64 sum's last
    bits)."""
    s = 0.0
    for i in range(a.shape[0]):
        s += np.float64(a[i])
    return s


@njit(cache=True)
def _collect(x, pen, work, ids, vals, lim):
    """ids/vals <- tokens with work >= lim (> 0), in id order -> (count, their mass). Whole chunks first
    pass a vectorized count (as _top_scan's): most hold no such token (a pass 31 -> 11 us over 49152)."""
    use_pen = pen.shape[0] > 0
    V = x.shape[0]
    whole = V - V % CHUNK
    n = 0
    mass = 0.0
    for base in range(0, whole, CHUNK):
        c = 0
        for i in range(base, base + CHUNK):
            c += (work[i] >= lim) & (work[i] > 0.0)
        if c > 0:
            n, mass = _gather(x, pen, use_pen, work, ids, vals, lim, base, base + CHUNK, n, mass)
    return _gather(x, pen, use_pen, work, ids, vals, lim, whole, V, n, mass)


@njit(cache=True, inline="always")
def _gather(x, pen, use_pen, work, ids, vals, lim, lo, hi, n, mass):
    """_collect over lo..hi, appending to its n tokens and their mass -> (n, mass)."""
    for i in range(lo, hi):
        e = work[i]
        if e >= lim and e > 0.0:
            ids[n] = i
            vals[n] = (x[i] - pen[i] if use_pen else x[i])
            mass += e
            n += 1
    return n, mass


@njit(cache=True)
def _heapsort(ids, vals, n):
    """Sort ids[:n]/vals[:n] in place into the canonical order (a total order, so any sort gives the same
    result). Hand-written, one function: np.argsort(kind="mergesort") alone cost seconds of cold compile."""
    for phase in range(2):
        start = n // 2 - 1 if phase == 0 else n - 1
        for it in range(start, -1 if phase == 0 else 0, -1):
            if phase == 0:  # build the heap: the root is the element that comes last
                root, end = it, n
            else:  # move the last-coming element to the end, restore the heap on the rest
                iv, vv = ids[0], vals[0]
                ids[0], vals[0] = ids[it], vals[it]
                ids[it], vals[it] = iv, vv
                root, end = 0, it
            while True:  # sift down
                c = 2 * root + 1
                if c >= end:
                    break
                d = c + 1  # pick the child that comes later (lower value, or equal value and higher id)
                if d < end and (vals[d] < vals[c] or (vals[d] == vals[c] and ids[d] > ids[c])):
                    c = d
                if not (vals[c] < vals[root] or (vals[c] == vals[root] and ids[c] > ids[root])):
                    break
                iv, vv = ids[root], vals[root]
                ids[root], vals[root] = ids[c], vals[c]
                ids[c], vals[c] = iv, vv
                root = c


@njit(cache=True)
def select_wide(x, pen, temperature, k, top_p, min_p, work, ids, vals, p):
    """The threshold path (top-k off or above KMAX); buffers (V,). See `select`."""
    m, vmax, norm = _exp_row(x, pen, temperature, work)
    if not (np.isfinite(vmax) and norm > 0.0):
        return -1
    if k == 0 and top_p >= 1.0 and min_p <= 0.0:  # untruncated: every allowed token, id order
        n, _ = _collect(x, pen, work, ids, vals, 0.0)
        for j in range(n):
            p[j] = work[ids[j]] / norm
        return n
    # Below `floor` min-p drops a token anyway (e = p / p_max; a hair lower so rounding never loses one). Not
    # with top-k: its probabilities are renormalised over all k, so all k are needed.
    floor = min_p * (1.0 - 1e-6) if min_p > 0.0 and k == 0 else 0.0
    lim = 0.36787944117144233  # e^-1, then e^-2, e^-4, ... of the top token
    while True:
        if lim <= floor:
            lim = floor
        n, mass = _collect(x, pen, work, ids, vals, lim)
        if k > 0:
            enough = n >= k  # the whole top-k set; top-p then applies within it
        else:
            enough = top_p < 1.0 and mass >= top_p * norm * _SLACK
        if enough or lim <= floor or lim == 0.0:
            break
        lim = lim * lim if lim > 1e-150 else 0.0
    _heapsort(ids, vals, n)
    if k > 0 and n > k:
        n = k
    if k > 0:  # top-k renormalises over the k kept, as the small-k path does
        norm = 0.0
        t = np.float32(temperature)
        for j in range(n):
            norm += np.exp(vals[j] / t - m)
    return _finish(vals, n, temperature, m, norm, top_p, min_p, p)


@njit(cache=True)
def select_top(x, pen, temperature, k, top_p, min_p, ids, vals, p):
    """The small top-k path (0 < k <= KMAX): one scan, then `_finish` over the k. See `select`."""
    n = top_scan(x, pen, k, ids, vals)
    if n == 0 or not np.isfinite(vals[0]):
        return -1
    t = np.float32(temperature)
    m = vals[0] / t
    norm = 0.0
    for j in range(n):
        norm += np.exp(vals[j] / t - m)
    return _finish(vals, n, temperature, m, norm, top_p, min_p, p)


@njit(cache=True)
def draw(p, n, u):
    """One uniform u in [0, 1) -> index into p[:n] by inverse CDF in candidate order: the first j whose
    cumulative mass (summed in order, float64) exceeds u * total; n - 1 if rounding leaves none."""
    total = 0.0
    for j in range(n):
        total += p[j]
    target, acc = u * total, 0.0
    for j in range(n):
        acc += p[j]
        if acc > target:
            return j
    return n - 1


@njit(cache=True)
def block_choice(x, pen, counts, temperature, k, top_p, min_p, presence, frequency, u, work, ids, vals, p):
    """One sampled choice inside a decode block (step): `select`'s path over x - pen (k as select
    takes it: 0 for off, else below the vocabulary; work as there), the draw with u, then what
    TokenChooser.accept does to the penalty state: counts[token] += 1 and, with a penalty row (pen
    non-empty), pen[token] = presence + frequency * count. -1 when no token is allowed."""
    if 0 < k <= KMAX:
        n = select_top(x, pen, temperature, k, top_p, min_p, ids, vals, p)
    else:
        n = select_wide(x, pen, temperature, k, top_p, min_p, work, ids, vals, p)
    if n <= 0:
        return -1
    tok = ids[draw(p, n, u)]
    counts[tok] += 1
    if pen.shape[0] > 0:
        pen[tok] = presence + frequency * counts[tok]
    return tok


class BlockChoice(NamedTuple):
    """How a decode block chooses each of its tokens inside the fused step (step._choose), from
    TokenChooser.block. One shape for every setting, so one compiled fused_forward serves them all; arrays a
    setting does not use are empty."""
    mode: int  # 0: the argmax; 1: block_choice (sampling, or greedy with penalties as top-1 sampling)
    temperature: float
    top_k: int  # as select takes it: 0 for off, else below the vocabulary (top_k_of)
    top_p: float
    min_p: float
    presence: float
    frequency: float
    pen: np.ndarray  # (V,) f32 penalty row, or empty
    counts: np.ndarray  # (V,) i32: each chosen token counted (the chooser's penalty state), or empty
    uniforms: np.ndarray  # (n,) f64: pass s draws with uniforms[s]
    work: np.ndarray  # (V,) f32 work row of the full-vocabulary path, or empty
    ids: np.ndarray  # select's candidate buffers: i64, f32, f64
    vals: np.ndarray
    p: np.ndarray


def argmax_choice(counts=None) -> BlockChoice:
    """A decode block's choice that takes the argmax, counting it into counts when given."""
    e32, e64 = np.zeros(0, np.float32), np.zeros(0, np.float64)
    return BlockChoice(0, 0.0, 0, 1.0, 0.0, 0.0, 0.0, e32, np.zeros(0, np.int32) if counts is None else counts,
                       e64, e32, np.zeros(0, np.int64), e32, e64)


def top_k_of(top_k: int, vocab: int) -> int:
    """The top-k the chain applies: 0 (off) for 0 or anything at or above the vocabulary."""
    return int(top_k) if 0 < top_k < vocab else 0


def select(x, pen, temperature, top_k, top_p, min_p, work, ids, vals, p):
    """Processed logits x - pen (V,) -> n candidates: ids[:n] (i64), p[:n] (f64, sums to 1), canonical order.

    pen (V,) f32 or empty; work (V,) f32 (only the threshold path uses it; may be empty otherwise); ids, vals,
    p: capacity top_k on the small-k path, V otherwise. Returns -1 when no token is allowed or the logits are
    not finite. top_k >= V counts as off. Plain Python: the two paths are separate jitted functions so a
    first start compiles only the one its settings use."""
    k = top_k_of(top_k, x.shape[0])
    if 0 < k <= KMAX:
        return select_top(x, pen, temperature, k, top_p, min_p, ids, vals, p)
    return select_wide(x, pen, temperature, k, top_p, min_p, work, ids, vals, p)


def compile_plan(greedy: bool, top_k: int, vocab: int) -> list:
    """[(dispatcher, argument types)] a `TokenChooser` with these settings will call, for compiling ahead (a
    background helper on a first start; a cached entry point carries its callees). Greedy without penalties or
    bans calls nothing jitted (np.argmax)."""
    from numba import types
    f32, i64, f64 = types.float32[::1], types.int64[::1], types.float64[::1]
    if greedy:
        return [(top_scan, (f32, f32, types.int64, i64, f32))]
    k = top_k_of(top_k, vocab)
    if 0 < k <= KMAX:
        return [(select_top, (f32, f32, types.float64, types.int64, types.float64, types.float64, i64, f32, f64)),
                (draw, (f64, types.int64, types.float64))]
    return [(select_wide, (f32, f32, types.float64, types.int64, types.float64, types.float64, f32, i64, f32,
                           f64)), (draw, (f64, types.int64, types.float64))]



@njit(cache=True, nogil=True, fastmath={"reassoc", "contract", "nsz"})
def softmax_top(x):
    """The softmax probability of the largest value of x (n,) f32: 1 / sum(exp(x - max)), the exponentials
    by attn.exp_fast (within ~2 ulp of libm's) summed in float32 vectors (reassociated: within ~1e-6 of
    numpy's float64 sum). A trained drafter's confidence in a draft (engine.spec.base.top_probability):
    numpy's form (a subtract, an exp and a sum over the row, three temporaries) cost ~55 us a row of 8192,
    three times a round with three MTP drafts."""
    n = x.shape[0]
    m0 = m1 = m2 = m3 = m4 = m5 = m6 = m7 = x[0]
    for i in range(0, n - n % 8, 8):
        m0, m1, m2, m3, m4, m5, m6, m7 = max_lanes8(m0, m1, m2, m3, m4, m5, m6, m7, x[i], x[i + 1], x[i + 2],
                                                    x[i + 3], x[i + 4], x[i + 5], x[i + 6], x[i + 7])
    m = max(m0, m1, m2, m3, m4, m5, m6, m7)
    for i in range(n - n % 8, n):
        m = max(m, x[i])
    s = np.float32(0.0)
    for i in range(n):
        s += exp_fast(x[i] - m)
    return 1.0 / np.float64(s)
