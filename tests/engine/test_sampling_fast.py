"""The jitted candidate set (engine.sampling_fast via `candidates` / `TokenChooser`) against a straightforward
full-sort numpy reference: many (temperature, top_k, top_p, min_p) settings, ties, bans, top_k >= vocab,
top_p = 1; the draw, penalties and bans inside `choose`; seeded determinism; the caller's logits untouched."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from engine.config import SamplingParams
from engine.sampling import TokenChooser, candidates


def ref_candidates(v, temperature, top_k, top_p, min_p):
    """Full sort of processed logits v: the candidate order of engine.sampling's docstring, float32 z / exp,
    float64 probabilities."""
    V = v.shape[0]
    allowed = v > -np.inf  # also drops NaN
    k = top_k if 0 < top_k < V else 0
    z_all = v / np.float32(temperature)
    m = z_all[allowed].max()
    e_all = np.exp(z_all - m).astype(np.float64)  # (V,)
    if k == 0 and top_p >= 1.0 and min_p <= 0.0:
        ids = np.flatnonzero(allowed)
        return ids, e_all[ids] / e_all[ids].sum()
    order = np.lexsort((np.arange(V), -v))  # value descending, ties by lower id
    ids = order[allowed[order]]
    if k:
        ids = ids[:k]
    p = e_all[ids] / (e_all[ids].sum() if k else e_all[allowed].sum())
    keep = len(ids)
    if top_p < 1.0:
        keep = min(keep, int(np.searchsorted(np.cumsum(p), top_p, side="left")) + 1)
    if min_p > 0.0:
        keep = min(keep, int(np.sum(p[:keep] >= min_p * p[0])))
    ids, p = ids[:keep], p[:keep]
    return ids, p / p.sum()


def _rows(V, seed):
    """Plain, tied (quantised), banned and tied+banned logit rows."""
    rng = np.random.default_rng(seed)
    plain = (rng.normal(size=V) * 2.5).astype(np.float32)
    tied = (np.round(plain * 2) / 2).astype(np.float32)
    banned = plain.copy()
    banned[rng.random(V) < 0.2] = -np.inf
    both = tied.copy()
    both[rng.random(V) < 0.2] = -np.inf
    return {"plain": plain, "tied": tied, "banned": banned, "tied+banned": both}


@pytest.mark.parametrize("V", [5, 63, 3001])
def test_candidates_match_full_sort_reference(V):
    temps = (0.3, 0.7, 1.0, 1.6)
    top_ks = sorted({0, 1, 2, 5, 20, 128, 129, 300, V - 1, V, V + 5} - {-1})
    top_ps = (1.0, 0.95, 0.8, 0.3)
    min_ps = (0.0, 0.05, 0.3)
    n = 0
    for name, x in _rows(V, V).items():
        before = x.copy()
        for t, k, tp, mp in itertools.product(temps, top_ks, top_ps, min_ps):
            ids, p = candidates(x, t, k, tp, mp)
            rid, rp = ref_candidates(x, t, k, tp, mp)
            assert ids.tolist() == rid.tolist(), (name, t, k, tp, mp)
            np.testing.assert_allclose(p, rp, rtol=1e-6, atol=1e-12, err_msg=str((name, t, k, tp, mp)))
            assert abs(float(p.sum()) - 1.0) < 1e-9
            n += 1
        np.testing.assert_array_equal(x, before)  # candidates never writes the caller's row
    assert n == 4 * len(temps) * len(top_ks) * len(top_ps) * len(min_ps)


def test_real_vocabulary_benchmark_settings_match_reference():
    rng = np.random.default_rng(11)
    for _ in range(5):
        x = (rng.normal(size=49152) * 3).astype(np.float32)
        for t, k, tp, mp in ((0.7, 20, 0.8, 0.0), (0.7, 0, 0.8, 0.0), (1.0, 0, 0.95, 0.05), (0.7, 40, 0.95, 0.05),
                             (0.8, 1000, 0.9, 0.0), (1.0, 0, 1.0, 0.02)):
            ids, p = candidates(x, t, k, tp, mp)
            rid, rp = ref_candidates(x, t, k, tp, mp)
            assert ids.tolist() == rid.tolist(), (t, k, tp, mp)
            np.testing.assert_allclose(p, rp, rtol=1e-6)


def test_ties_at_the_top_k_boundary_keep_lowest_ids():
    x = np.array([1.0, 3.0, 2.0, 3.0, 2.0, 2.0, 0.5], np.float32)
    ids, p = candidates(x, 1.0, 3, 1.0, 0.0)
    assert ids.tolist() == [1, 3, 2]  # 3.0 (ids 1, 3), then the lowest id among the 2.0 ties
    assert p[0] == p[1] > p[2]


def test_everything_banned_or_not_finite_raises():
    with pytest.raises(ValueError):
        candidates(np.full(10, -np.inf, np.float32), 1.0, 3, 1.0, 0.0)
    with pytest.raises(ValueError):
        candidates(np.full(10, -np.inf, np.float32), 1.0, 0, 0.9, 0.0)
    bad = np.zeros(10, np.float32)
    bad[4] = np.inf
    with pytest.raises(ValueError):
        candidates(bad, 1.0, 3, 1.0, 0.0)


class _Banner:
    """A thinking state stand-in: bans a fixed set, never forces, never redirects."""

    def __init__(self, ban):
        self._ban = frozenset(ban)

    def force(self):
        return None

    def ban(self):
        return self._ban

    def redirect(self, tok):
        return tok

    def accept(self, tok):
        pass


@pytest.mark.parametrize("top_k,top_p,min_p", [(20, 0.8, 0.0), (0, 0.8, 0.0), (0, 1.0, 0.0), (300, 0.9, 0.1)])
def test_choose_is_the_reference_draw_over_penalised_banned_logits(top_k, top_p, min_p):
    V = 2000
    rng = np.random.default_rng(5)
    rows = (rng.normal(size=(60, V)) * 2).astype(np.float32)
    rows[:, :30] += 4.0  # a favoured block, so penalties keep changing the top
    ban = (3, 7, 11)
    sp = SamplingParams(temperature=0.7, top_k=top_k, top_p=top_p, min_p=min_p, presence_penalty=1.5,
                        frequency_penalty=0.3, seed=42)
    ch = TokenChooser(sp, V, thinking=_Banner(ban))
    us = np.random.default_rng(42)  # the same stream the chooser draws from
    counts = np.zeros(V)
    for r in rows:
        before = r.copy()
        v = r - (1.5 * (counts > 0) + 0.3 * counts).astype(np.float32)
        v[list(ban)] = -np.inf
        rid, rp = ref_candidates(v, 0.7, top_k, top_p, min_p)
        want = int(rid[min(int(np.searchsorted(np.cumsum(rp), us.random(), side="right")), len(rid) - 1)])
        got = ch.choose(r)
        assert got == want
        np.testing.assert_array_equal(r, before)  # the caller's row is untouched (penalties and bans too)
        ch.accept(got)
        counts[got] += 1
    assert ch._pen[list(ban)].tolist() == [0.0, 0.0, 0.0]  # bans last one call, they do not stick
    assert len(set(np.flatnonzero(counts))) > 5


def test_greedy_applies_penalties_and_bans_without_touching_the_row():
    V = 4099
    rng = np.random.default_rng(9)
    ch = TokenChooser(SamplingParams(greedy=True, presence_penalty=2.0), V, thinking=_Banner({0}))
    row = rng.normal(size=V).astype(np.float32)
    row[0] = 50.0  # banned: never chosen
    before = row.copy()
    seen = []
    for _ in range(20):
        t = ch.choose(row)
        assert t == int(np.argmax(ch._processed(row)))
        ch.accept(t)
        seen.append(t)
    np.testing.assert_array_equal(row, before)
    assert 0 not in seen and len(set(seen)) == 20  # the presence penalty moves greedy on every step


def test_seeded_determinism_on_the_benchmark_setting():
    rng = np.random.default_rng(2)
    rows = (rng.normal(size=(40, 49152)) * 3).astype(np.float32)

    def run(seed):
        sp = SamplingParams(temperature=0.7, top_k=20, top_p=0.8, presence_penalty=1.5, seed=seed)
        ch = TokenChooser(sp, 49152)
        out = []
        for r in rows:
            out.append(ch.choose(r))
            ch.accept(out[-1])
        return out

    a = run(42)
    assert a == run(42) and a != run(7)


@pytest.mark.parametrize("sp", [SamplingParams(greedy=True, presence_penalty=1.5),
                                SamplingParams(temperature=0.7, top_k=20, top_p=0.8, presence_penalty=1.5),
                                SamplingParams(temperature=0.7, top_p=0.8)])
def test_compile_plan_names_the_signatures_choose_uses(sp):
    """What a background compile would build is what `choose` then calls (else the cache would not serve it)."""
    from engine.sampling_fast import compile_plan
    ch = TokenChooser(sp, 300, thinking=_Banner({1}))
    row = np.random.default_rng(0).normal(size=300).astype(np.float32)
    ch.accept(ch.choose(row))
    plan = compile_plan(sp.is_greedy, sp.top_k, 300)
    assert plan
    for disp, sig in plan:
        assert tuple(sig) in [tuple(s) for s in disp.signatures], (disp, sig, disp.signatures)


@pytest.mark.parametrize("n", [1, 7, 8, 63, 64, 65, 3001])
def test_lanes_max_is_the_max_of_the_penalised_row_ignoring_nan(n):
    """The vectorized maximum behind top_scan's first chunks and select_wide's exp row: any length (the eight
    lanes' rest), a penalty row or none, NaN never counted, -inf where nothing else is."""
    from numba import njit

    from engine.sampling_fast import _lanes_max
    lanes = njit(lambda x, pen, lo, hi: _lanes_max(x[lo:hi], pen[lo:hi], pen.shape[0] > 0))
    rng = np.random.default_rng(n)
    x = (rng.normal(size=n) * 3).astype(np.float32)
    x[rng.random(n) < 0.1] = np.nan
    x[rng.random(n) < 0.1] = -np.inf
    pen = (rng.random(n) * 2).astype(np.float32)
    for p in (pen, pen[:0]):
        v = x - p if p.shape[0] else x
        for lo, hi in ((0, n), (n // 3, n), (0, (2 * n) // 3)):
            got = lanes(x, p, lo, hi)
            seg = v[lo:hi][~np.isnan(v[lo:hi])]
            assert got == (seg.max() if seg.size else -np.inf), (lo, hi)
    assert lanes(np.full(9, np.nan, np.float32), pen[:0], 0, 9) == -np.inf


def test_softmax_top_matches_numpy():
    """softmax_top (a drafter's confidence: engine.spec.base.top_probability) against numpy's float64 form,
    over flat and peaked rows, lengths that are and are not a multiple of its 8 lanes, the maximum anywhere."""
    from engine.sampling_fast import softmax_top
    rng = np.random.default_rng(4)
    for n in (1, 7, 8, 8192, 8193):
        for scale in (0.1, 3.0, 40.0):
            x = (rng.standard_normal(n) * scale).astype(np.float32)
            x[rng.integers(n)] += scale
            want = 1.0 / np.exp((x - x.max()).astype(np.float64)).sum()
            assert softmax_top(x) == pytest.approx(want, rel=2e-6), (n, scale)
