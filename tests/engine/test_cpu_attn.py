"""cpu_attn: half -> float conversion and the split decode attention at a real model's shapes."""
import os
import subprocess
import sys
from pathlib import Path

import numba
import numpy as np
import pytest

from engine.backends.cpu import attn as cpu_attn
from engine.backends.cpu import attn_int8 as cpu_attn_int8
from engine.backends.ref import kernels as ref
from engine.backends.cpu.attn_softmax import softmax_row


def _convert_all(h2f):
    @numba.njit
    def run(out, bits):
        for i in range(bits.shape[0]):
            out[i] = h2f(bits[i])
    return run


@pytest.mark.parametrize("kind", ["soft", "hw"])
def test_h2f_matches_numpy_on_every_finite_half(kind):
    if kind == "hw" and not cpu_attn.HAS_F16C:
        pytest.skip("no F16C on this CPU")
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    bits = bits[np.isfinite(bits.view(np.float16))]
    out = np.empty(bits.shape[0], np.float32)
    _convert_all(cpu_attn.h2f_soft if kind == "soft" else cpu_attn.h2f_hw)(out, bits)
    np.testing.assert_array_equal(out.view(np.uint32), bits.view(np.float16).astype(np.float32).view(np.uint32))


@pytest.mark.parametrize("pos0,t_n", [(597, 3), (61, 1), (2, 2)])  # uneven chunks, 8- and 4-position tails
@pytest.mark.parametrize("n_kv,hd,n_head", [(3, 64, 9), (2, 128, 4)])  # SmolLM2-135M; a 128-wide head (Qwen)
def test_split_attention_matches_reference_at_model_shapes(pos0, t_n, n_kv, hd, n_head):
    rng = np.random.default_rng(pos0)
    cap = 640
    k = (rng.standard_normal((cap, n_kv, hd)) * 2).astype(np.float16)
    v = rng.standard_normal((cap, n_kv, hd)).astype(np.float16)
    q = rng.standard_normal((t_n, n_head, hd)).astype(np.float32)
    want = np.zeros_like(q)
    ref.attention_f16(want, q, k, v, pos0, 0.125)
    got = np.zeros_like(q)
    nt = numba.config.NUMBA_NUM_THREADS
    part = np.full((t_n + 2, n_kv, cpu_attn.SPLITS, n_head // n_kv, hd + 2), np.nan, np.float32)  # unused rows
    cpu_attn.attention_f16_split(got, q, k.view(np.uint16), v.view(np.uint16), pos0, np.float32(0.125),
                                 np.zeros((nt, n_head, cap), np.float32),
                                 part)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("pos0,t_n", [(597, 3), (61, 1), (2, 2)])
@pytest.mark.parametrize("n_kv,hd,n_head", [(3, 64, 9), (2, 128, 4)])
def test_split_int8_attention_matches_reference(pos0, t_n, n_kv, hd, n_head):
    rng = np.random.default_rng(pos0 + 1)
    cap = 640
    group = ref.kv_group(hd)
    k = (rng.standard_normal((cap, n_kv, hd)) * 2).astype(np.float32)
    v = rng.standard_normal((cap, n_kv, hd)).astype(np.float32)
    kq, ks = ref.quantize_kv_int8(k, group)
    vq, vs = ref.quantize_kv_int8(v, group)
    q = rng.standard_normal((t_n, n_head, hd)).astype(np.float32)
    want = np.zeros_like(q)
    # where the target has AVX512-VNNI the scores multiply the query in 16 bits per value (two int8 parts)
    vnni = cpu_attn_int8.VNNI512 and cpu_attn.VECTOR_ATTN and cpu_attn_int8.usable(n_head, n_kv, hd, hd // group)
    (ref.attention_int8_q16 if vnni else ref.attention_int8)(want, q, kq, ks, vq, vs, pos0, 0.125)
    got = np.zeros_like(q)
    nt = numba.config.NUMBA_NUM_THREADS
    cpu_attn_int8.attention_int8_split(got, q, kq, ks, vq, vs, pos0, np.float32(0.125),
                                  np.zeros((nt, n_head, cap), np.float32),
                                  np.zeros((t_n, n_kv, cpu_attn.SPLITS, n_head // n_kv, hd + 2), np.float32))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@numba.njit(fastmath=True)
def _items(which, part, sc, qt, kc, vc, chunks):
    for c in range(chunks.shape[0]):
        lo, hi = chunks[c, 0], chunks[c, 1]
        if which == 0:
            cpu_attn._item_heads_loops(part, sc, qt, (kc, vc), 0, c, lo, hi, np.float32(0.125))
        else:
            cpu_attn._item_heads_vec(part, sc, qt, (kc, vc), 0, c, lo, hi, np.float32(0.125))


@numba.njit(fastmath=True)
def _items_q8(which, part, sc, qt, kq, ks, vq, vs, chunks):
    for c in range(chunks.shape[0]):
        lo, hi = chunks[c, 0], chunks[c, 1]
        if which == 0:
            cpu_attn_int8._item_heads_q8_loops(part, sc, qt, (kq, ks, vq, vs), 0, c, lo, hi, np.float32(0.125))
        else:
            cpu_attn_int8._item_heads_q8_vec(part, sc, qt, (kq, ks, vq, vs), 0, c, lo, hi, np.float32(0.125))


# chunks (lo, hi) of one row: 8-, 4- and single-position tails, V sums over one and several V_BLOCKs
CHUNKS = np.array([(0, 1), (3, 7), (5, 13), (0, 12), (9, 24), (1, 28), (7, 64), (0, 71), (2, 80)], np.int64)


def _check_items(run, qt, k, v, hd):
    """Both item forms (which 0: numba loops, 1: IR) against numpy: part[0, kh, c] holds the chunk's weighted
    V sum (by exp(score - max)), max and sum for every head of every KV head."""
    n_head, n_kv = qt.shape[0], k.shape[1]
    group = n_head // n_kv
    for which in (0, 1):
        part = np.zeros((1, n_kv, len(CHUNKS), group, hd + 2), np.float32)  # as _clear_part leaves it
        run(which, part, np.full((n_head, 96), np.nan, np.float32))
        for c, (lo, hi) in enumerate(CHUNKS):
            for h in range(n_head):
                s = 0.125 * k[lo:hi, h // group] @ qt[h].astype(np.float64)
                e = np.exp(s - s.max())
                got = part[0, h // group, c, h % group]
                np.testing.assert_allclose(got[hd], s.max(), rtol=1e-5, atol=1e-5)
                np.testing.assert_allclose(got[hd + 1], e.sum(), rtol=1e-4)
                np.testing.assert_allclose(got[:hd], e @ v[lo:hi, h // group], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("hd,n_kv,n_head", [(64, 3, 9), (128, 3, 9), (16, 3, 9), (40, 3, 9), (42, 3, 9), (8, 3, 9),
                                           (64, 2, 12), (42, 2, 4), (64, 4, 4), (128, 2, 8), (40, 4, 8)])
def test_vector_items_match_numba_loops_and_numpy(hd, n_kv, n_head):
    """cpu_attn's work item through cpu_attn_avx2 (positions outer) and through the numba loops that other
    CPUs run (one KV head after the other), against numpy, over chunks that exercise every tail (hd 16, 40:
    8-lane parts; 42: a masked last block); GQA groups of 3 and 6 take the grouped kernels, 2 and 4 the pair
    kernels, 1 neither."""
    if not cpu_attn.VECTOR_ATTN:
        pytest.skip("target without AVX2/FMA/F16C (or NINFER_CPU_GENERIC set)")
    rng = np.random.default_rng(hd + n_head)
    cap = 96
    kc = rng.standard_normal((2, cap, n_kv, hd)).astype(np.float16)  # a layer of a 4-d cache: strided rows
    vc = rng.standard_normal((2, cap, n_kv, hd)).astype(np.float16)
    qt = rng.standard_normal((n_head, hd)).astype(np.float32)
    _check_items(lambda which, part, sc: _items(which, part, sc, qt, kc[1].view(np.uint16), vc[1].view(np.uint16),
                                                CHUNKS),
                 qt, kc[1].astype(np.float64), vc[1].astype(np.float64), hd)


@numba.njit(fastmath=True)
def _scores_and_sums(grouped, sc, acc, qt, kc, vc, n):
    """Scores of positions 0..n of the heads of qt (3 or 2; KV head 1) over kc, then their weighted V sums
    into acc, by the grouped kernels (the triple or the pair forms) or by one call per head."""
    A = cpu_attn
    heads = qt.shape[0]
    p = 0
    while p + 8 <= n:
        # the rows asked for as these are read (prefetches: no bits change; 32 on runs past the cache's end,
        # and 0, a null address, neither faults)
        ahead = np.int64(kc.ctypes.data) + kc.strides[0] * (p + 32) if grouped else np.int64(0)
        if grouped and heads == 3:
            A.kdot8_heads(sc, p, qt, kc, p, 1, np.float32(0.125), ahead)
        elif grouped:
            A.kdot8_pairs(sc, p, qt, kc, p, 1, np.float32(0.125), ahead)
        else:
            for h in range(heads):
                A.kdot8(sc[h], p, qt[h], kc, p, 1, np.float32(0.125), ahead)
        p += 8
    if p + 4 <= n:
        ahead = np.int64(kc.ctypes.data) + kc.strides[0] * (p + 32) if grouped else np.int64(0)
        if grouped and heads == 3:
            A.kdot4_heads(sc, p, qt, kc, p, 1, np.float32(0.125), ahead)
        elif grouped:
            A.kdot4_pairs(sc, p, qt, kc, p, 1, np.float32(0.125), ahead)
        else:
            for h in range(heads):
                A.kdot4(sc[h], p, qt[h], kc, p, 1, np.float32(0.125), ahead)
    for b in range(0, n, 32):
        m = min(32, n - b)
        ahead = np.int64(vc.ctypes.data) + vc.strides[0] * (b + 32) if grouped else np.int64(0)
        if grouped and heads == 3:
            A.vsum_heads(acc, sc, b, m, vc, b, 1, ahead)
        elif grouped:
            A.vsum_pairs(acc, sc, b, m, vc, b, 1, ahead)
        else:
            for h in range(heads):
                A.vsum(acc[h], sc[h], b, m, vc, b, 1, ahead)


@pytest.mark.parametrize("heads", [3, 2])
@pytest.mark.parametrize("hd", [64, 8, 12, 72, 100, 128])
def test_grouped_kernels_give_the_per_head_bits(hd, heads):
    """kdot8_heads / kdot4_heads / vsum_heads (one K or V conversion for the 3 heads of a GQA group) and the
    pair forms (2 heads: groups of 2 and 4) keep each head's chains of multiply-adds: the same bits as one
    kdot / vsum per head, masked tails included."""
    if not cpu_attn.VECTOR_ATTN:
        pytest.skip("target without AVX2/FMA/F16C (or NINFER_CPU_GENERIC set)")
    rng = np.random.default_rng(hd)
    kc, vc = (rng.standard_normal((140, 3, hd)).astype(np.float16).view(np.uint16) for _ in range(2))
    qt = rng.standard_normal((heads, hd)).astype(np.float32)
    out = []
    for grouped in (False, True):
        sc = np.full((heads, 160), np.nan, np.float32)
        acc = np.full((heads, hd + 2), 0.5, np.float32)
        _scores_and_sums(grouped, sc, acc, qt, kc, vc, 140)
        out.append((sc, acc))
    assert np.array_equal(out[0][0][:, :140], out[1][0][:, :140])
    assert np.array_equal(out[0][1], out[1][1])
    assert np.isfinite(out[1][1]).all() and not np.array_equal(out[1][1], np.full_like(out[1][1], 0.5))


@numba.njit(fastmath=True)
def _scores_and_sums_q8(grouped, sc, acc, qt, kq, ks, vq, vs, n):
    """_scores_and_sums over an int8 cache (cpu_attn_int8_avx2's kernels; 3 heads: the grouped forms, 2: the
    pair forms)."""
    A = cpu_attn
    heads = qt.shape[0]
    p = 0
    while p + 8 <= n:
        if grouped and heads == 3:
            A.kdot8_q8_heads(sc, p, qt, kq, ks, p, 1, np.float32(0.125))
        elif grouped:
            A.kdot8_q8_pairs(sc, p, qt, kq, ks, p, 1, np.float32(0.125))
        else:
            for h in range(heads):
                A.kdot8_q8(sc[h], p, qt[h], kq, ks, p, 1, np.float32(0.125))
        p += 8
    if p + 4 <= n:
        if grouped and heads == 3:
            A.kdot4_q8_heads(sc, p, qt, kq, ks, p, 1, np.float32(0.125))
        elif grouped:
            A.kdot4_q8_pairs(sc, p, qt, kq, ks, p, 1, np.float32(0.125))
        else:
            for h in range(heads):
                A.kdot4_q8(sc[h], p, qt[h], kq, ks, p, 1, np.float32(0.125))
    for b in range(0, n, 32):
        m = min(32, n - b)
        ahead = np.int64(vq.ctypes.data) + vq.strides[0] * (b + 32) if grouped else np.int64(0)
        if grouped and heads == 3:
            A.vsum_q8_heads(acc, sc, b, m, vq, vs, b, 1, ahead)
        elif grouped:
            A.vsum_q8_pairs(acc, sc, b, m, vq, vs, b, 1, ahead)
        else:
            for h in range(heads):
                A.vsum_q8(acc[h], sc[h], b, m, vq, vs, b, 1, ahead)


@pytest.mark.parametrize("heads", [3, 2])
@pytest.mark.parametrize("hd,gs", [(64, 32), (64, 64), (48, 16), (16, 8)])
def test_grouped_int8_kernels_give_the_per_head_bits(hd, gs, heads):
    """The same over an int8 cache: group scales of 32, 64, 16 and 8 values (8- and 32-lane parts), the grouped
    (3 heads) and pair (2 heads) forms."""
    if not cpu_attn.VECTOR_ATTN:
        pytest.skip("target without AVX2/FMA/F16C (or NINFER_CPU_GENERIC set)")
    rng = np.random.default_rng(hd + gs)
    (kq, ks), (vq, vs) = (ref.quantize_kv_int8(rng.standard_normal((140, 3, hd)).astype(np.float32), gs)
                          for _ in range(2))
    qt = rng.standard_normal((heads, hd)).astype(np.float32)
    out = []
    for grouped in (False, True):
        sc = np.full((heads, 160), np.nan, np.float32)
        acc = np.full((heads, hd + 2), 0.5, np.float32)
        _scores_and_sums_q8(grouped, sc, acc, qt, kq, ks, vq, vs, 140)
        out.append((sc, acc))
    assert np.array_equal(out[0][0][:, :140], out[1][0][:, :140])
    assert np.array_equal(out[0][1], out[1][1])
    assert np.isfinite(out[1][1]).all() and not np.array_equal(out[1][1], np.full_like(out[1][1], 0.5))


@pytest.mark.parametrize("hd,gs,n_kv,n_head", [(64, 32, 3, 9), (128, 32, 3, 9), (64, 64, 3, 9), (96, 32, 3, 9),
                                              (48, 16, 3, 9), (16, 8, 3, 9), (40, 40, 3, 9), (12, 12, 3, 9),
                                              (64, 32, 2, 12), (64, 32, 2, 4), (64, 32, 2, 16), (128, 32, 4, 16)])
def test_int8_vector_items_match_numba_loops_and_numpy(hd, gs, n_kv, n_head):
    """The same over an int8 cache (cpu_attn_int8_avx2): groups of 32 lanes and of 8; groups that are not a
    multiple of 8 values (40, 12) take the loops."""
    if not cpu_attn.VECTOR_ATTN:
        pytest.skip("target without AVX2/FMA/F16C (or NINFER_CPU_GENERIC set)")
    rng = np.random.default_rng(hd + gs + n_head)
    cap = 96
    k = rng.standard_normal((2, cap, n_kv, hd)).astype(np.float32)
    v = rng.standard_normal((2, cap, n_kv, hd)).astype(np.float32)
    kq, ks = (np.stack(x) for x in zip(*(ref.quantize_kv_int8(k[i], gs) for i in range(2))))
    vq, vs = (np.stack(x) for x in zip(*(ref.quantize_kv_int8(v[i], gs) for i in range(2))))
    qt = rng.standard_normal((n_head, hd)).astype(np.float32)
    _check_items(lambda which, part, sc: _items_q8(which, part, sc, qt, kq[1], ks[1], vq[1], vs[1], CHUNKS),
                 qt, ref.dequantize_kv_int8(kq[1], ks[1]), ref.dequantize_kv_int8(vq[1], vs[1]), hd)


def test_generic_env_selects_the_numba_loops():
    """NINFER_CPU_GENERIC=1 (what a CPU without AVX2 runs) takes the numba loops (tested above), f16 and int8,
    and the numba softmax."""
    root = Path(__file__).resolve().parents[2]
    code = ("from engine.backends.cpu import attn as A, attn_int8 as B; "
            "print(A.VECTOR_ATTN, A._item_heads is A._item_heads_loops, B._item_heads_q8 is B._item_heads_q8_loops, "
            "A._softmax_rows is A._softmax_rows_loops)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(root), timeout=300,
                       env=dict(os.environ, NINFER_CPU_GENERIC="1", PYTHONPATH=str(root)))
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == ["False", "True", "True", "True"]


@numba.njit
def _softmax_vec_rows(s, n, pc):
    for g in range(s.shape[0]):
        pc[g, 0], pc[g, 1] = softmax_row(s[g], n)


@pytest.mark.parametrize("n", [1, 7, 8, 15, 16, 17, 31, 33, 150, 257])
def test_softmax_row_matches_numpy_and_leaves_the_rest(n):
    """The IR softmax of a scores row (every score in vectors, a masked rest): exp(s - max) in place, the
    max and the sum returned, the floats past n untouched; the numba loops agree to rounding."""
    rng = np.random.default_rng(n)
    s = (rng.standard_normal((3, n + 40)) * 20).astype(np.float32)
    s[:, n:] = 12345.0  # past n: must be neither read into the max nor written
    if n > 3:
        s[1, 3] = -200.0  # an exp that underflows to the clamp's value (exp(-87) ~ 1.6e-38)
    before = s.copy()
    loops, pc, loops_pc = s.copy(), np.zeros((3, 2), np.float32), np.zeros((3, 2), np.float32)
    _softmax_vec_rows(s, n, pc)
    cpu_attn._softmax_rows_loops(loops_pc, loops, n)
    for g in range(3):
        x = before[g, :n].astype(np.float64)
        e = np.exp(np.maximum(x - x.max(), -87.0))
        assert pc[g, 0] == np.float32(x.max())
        np.testing.assert_allclose(s[g, :n], e, rtol=1e-5, atol=1e-37)  # r = x - n ln2 carries |x| ulps
        np.testing.assert_allclose(pc[g, 1], e.sum(), rtol=2e-6)
        np.testing.assert_array_equal(s[g, n:], before[g, n:])
        np.testing.assert_allclose(s[g, :n], loops[g, :n], rtol=2e-6, atol=1e-37)
        np.testing.assert_allclose(pc[g, 1], loops_pc[g, 1], rtol=2e-6)


def _vnni_or_skip():
    if not (cpu_attn.VECTOR_ATTN and cpu_attn_int8.VNNI512):
        pytest.skip("target without AVX512-VNNI (or NINFER_CPU_GENERIC set)")


# The scores kernel alone (its wrapper compiles the kernel's code again: ~0.5 s since its stack buffers are not
# zeroed, ~45 s before, when these ran on demand only).
@numba.njit(fastmath=True)
def _scores_vnni(sc, qt, kq, ks, lo, n):
    cpu_attn_int8.scores_q8_vnni(sc, qt, kq, ks, lo, n, np.float32(0.125))


@pytest.mark.parametrize("hd,n_kv,n_head", [(64, 3, 9), (128, 2, 4), (64, 2, 12), (64, 4, 4), (192, 1, 8)])
@pytest.mark.parametrize("lo,n", [(0, 8), (5, 1), (3, 13), (0, 71), (40, 24)])  # whole and partial blocks of 8
def test_vnni_scores_are_the_quantized_query_dot_products(hd, n_kv, n_head, lo, n):
    """scores_q8_vnni against numpy: the query rows in 16 bits per value as two int8 parts per 32 values
    (ref.quantize_query_q16), dotted with K's quants, times the K scales; every query head, positions
    lo:lo + n only (the rest of each score row untouched)."""
    _vnni_or_skip()
    rng = np.random.default_rng(hd + 7 * n + lo)
    (kq, ks), _ = (ref.quantize_kv_int8((rng.standard_normal((96, n_kv, hd)) * 3).astype(np.float32), 32)
                   for _ in range(2))  # (the V draw kept: the same query as before the scores stopped taking V)
    qt = (rng.standard_normal((n_head, hd)) * 2).astype(np.float32)
    sc = np.full((n_head, 100), np.nan, np.float32)
    _scores_vnni(sc, qt, kq, ks, lo, n)
    q16 = ref.quantize_query_q16(qt, 32)
    assert 0 < np.abs(q16 - qt).max() < 2e-4 * np.abs(qt).max()  # 16 bits, not the float query
    group = n_head // n_kv
    for h in range(n_head):
        kh = h // group
        kf = ref.dequantize_kv_int8(kq[lo:lo + n], ks[lo:lo + n])[:, kh]
        want = 0.125 * kf @ q16[h]
        np.testing.assert_allclose(sc[h, :n], want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
        assert np.isnan(sc[h, n:]).all()


def test_vnni_scores_quantize_a_zero_query_group_to_zero():
    """A query group of zeros (scale 0) adds nothing, and the group beside it scores as alone."""
    _vnni_or_skip()
    rng = np.random.default_rng(3)
    kq, ks = ref.quantize_kv_int8(rng.standard_normal((16, 1, 64)).astype(np.float32), 32)
    qt = rng.standard_normal((1, 64)).astype(np.float32)
    qt[0, :32] = 0
    sc = np.zeros((1, 16), np.float32)
    _scores_vnni(sc, qt, kq, ks, 0, 16)
    want = 0.125 * ref.dequantize_kv_int8(kq, ks)[:, 0, 32:] @ ref.quantize_query_q16(qt, 32)[0, 32:]
    np.testing.assert_allclose(sc[0], want, rtol=1e-5)


def test_vnni_item_serves_only_the_shapes_it_can():
    """usable(): 64-value blocks of 32-value groups, at most GMAX query heads per KV head, the stack buffers."""
    from engine.backends.cpu.attn_int8_vnni import GMAX, QBYTES, usable
    assert usable(9, 3, 64, 2) and usable(32, 8, 128, 4) and usable(64, 8, 128, 4)  # SmolLM2, 8B, 64 heads
    assert not usable(9, 3, 96, 3)  # 96 is not whole 64-value blocks
    assert not usable(9, 3, 64, 1)  # one 64-value group
    assert not usable(2 * GMAX, 1, 64, 2)  # too many query heads per KV head
    n = QBYTES // 128 + GMAX  # more query values than the stack buffer holds, GMAX heads per KV head
    assert not usable(n, n // GMAX, 128, 4)
