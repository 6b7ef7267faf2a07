"""Decode attention over the KV cache for the fused CPU step (numba), and the f16 helpers it needs.

Why a kernel of its own: at 600 tokens of context attention was ~3 ms of a ~13 ms decode step; the time
went into instructions, not memory (the same kernel on an L2-resident cache was barely faster):
- half -> float conversion: `h2f` is one `vcvtph2ps` (F16C) through an LLVM intrinsic; the branch-free
  integer version (kept as the fallback for CPUs without F16C) cost ~2x more per element.
- per-position overhead: a 64-long dot product is only 8 vector FMAs, so loop setup, trip-count checks
  and the horizontal sum weighed as much as the math. The numba loops here (`_scores_loops`,
  `_weighted_sum_loops`) do four positions per pass; where the target has AVX2/FMA/F16C the IR blocks of
  attn_avx2 replace them (no per-position horizontal sum, V accumulators in registers): 1.8x faster
  work items at 600 positions (scripts/attn_parts.py).

Also here: `exp_fast` (vectorizable exp), `f2h` / `store_f16` (writing the f16 cache).
"""
from __future__ import annotations

from ... import numba_env  # noqa: F401  (flags before numba)

import os

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload

from .attn_avx2 import (GROUP_HEADS, kdot4, kdot4_heads, kdot4_pairs, kdot8, kdot8_heads, kdot8_pairs, vsum,
                        vsum_heads, vsum_pairs)
from .attn_int8_avx2 import (kdot4_q8, kdot4_q8_heads, kdot4_q8_pairs, kdot8_q8, kdot8_q8_heads, kdot8_q8_pairs,
                             vsum_q8, vsum_q8_heads, vsum_q8_pairs)
from .attn_fetch import burst_k_ahead, burst_kv, burst_v_scales, fetch_kv, first_rows, is_f16, k_ahead, v_ahead
from .attn_softmax import EXP_LN2_HI, EXP_LN2_LO, EXP_LOG2E, EXP_POLY, softmax_row
from .target import target_has

F32 = np.float32
_LOG2E, _LN2_HI, _LN2_LO = F32(EXP_LOG2E), F32(EXP_LN2_HI), F32(EXP_LN2_LO)

SPLITS = 4  # decode attention: positions split in this many chunks per row (balanced over threads)
V_BLOCK = 32  # positions per pass of the weighted V sums over every head (12 KiB of V rows at 3 heads of 64)


@njit(cache=True, nogil=True, fastmath=True, inline="always")
def exp_fast(x):
    """exp(x) for float32 x, vectorizable (no libm call); exact to ~2 ulp on [-87, 88], 0 below."""
    x = min(max(x, F32(-87.0)), F32(88.0))
    n = np.floor(x * _LOG2E + F32(0.5))
    r = x - n * _LN2_HI - n * _LN2_LO  # |r| <= ln2/2
    p = F32(EXP_POLY[0])  # the constants are attn_softmax's, whose vector form computes the same
    p = p * r + F32(EXP_POLY[1])
    p = p * r + F32(EXP_POLY[2])
    p = p * r + F32(EXP_POLY[3])
    p = p * r + F32(EXP_POLY[4])
    p = p * r + F32(EXP_POLY[5])
    p = p * r + F32(EXP_POLY[6])
    bits = np.int32(np.int32(np.int32(n) + np.int32(127)) << np.int32(23))
    return p * bits.view(np.float32)


@njit(cache=True, nogil=True, inline="always")
def f32_to_f16_bits(f):
    """float32 -> IEEE half bit pattern (uint16), round to nearest even; overflow -> inf, NaN kept."""
    x = np.float32(f).view(np.uint32)
    sign = np.uint32((x >> np.uint32(16)) & np.uint32(0x8000))
    a = x & np.uint32(0x7FFFFFFF)
    if a >= np.uint32(0x7F800000):  # inf / nan
        h = np.uint32(0x7C00) | (np.uint32(0x200) if a > np.uint32(0x7F800000) else np.uint32(0))
    elif a >= np.uint32(0x477FF000):  # rounds to >= 65520: overflow
        h = np.uint32(0x7C00)
    elif a < np.uint32(0x38800000):  # below the smallest normal half: subnormal, value / 2^-24
        h = np.uint32(np.rint(abs(np.float32(f)) * np.float32(16777216.0)))
    else:
        rounded = np.uint32(a + np.uint32(0x0FFF) + ((a >> np.uint32(13)) & np.uint32(1)))
        h = np.uint32(np.uint32(rounded - np.uint32(0x38000000)) >> np.uint32(13))
    return np.uint16(sign | h)


# ------------------------------------------------------------------------------------ half -> float
@njit(cache=True, nogil=True, fastmath=True, inline="always")
def h2f_soft(h):
    """half bits (uint16) -> float32 without branches (finite values incl. subnormals): shift the
    exponent/mantissa into float position, rescale by 2^112, then copy the sign bit."""
    u = np.uint32(h)
    mag = F32(np.uint32((u & np.uint32(0x7FFF)) << np.uint32(13)).view(np.float32) * F32(5.192296858534828e33))
    sign = np.uint32((u & np.uint32(0x8000)) << np.uint32(16))
    return np.uint32(np.float32(mag).view(np.uint32) | sign).view(np.float32)


@intrinsic
def h2f_hw(typingctx, h):
    """half bits (uint16) -> float32 as LLVM `fpext half`: vcvtph2ps with F16C, vectorized in loops (numba
    has no float16 type on the CPU). Only used where the target has F16C (else LLVM would call a
    runtime helper that numba does not link)."""
    if h != types.uint16:
        return None

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(types.uint16), codegen


@intrinsic
def f2h_hw(typingctx, f):
    """float32 -> half bits (uint16) as LLVM `fptrunc` to half: vcvtps2ph with F16C (round to nearest even,
    f32_to_f16_bits' result for every non-NaN value), vectorized in loops. Only where the target has F16C."""
    if f != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
    return types.uint16(types.float32), codegen


# NINFER_CPU_GENERIC=1 forces the numba loops that CPUs without AVX2 run, here and for fast's matmuls
# (tests; run with a fresh NUMBA_CACHE_DIR: numba's cache does not see this switch)
GENERIC_FORCED = os.environ.get("NINFER_CPU_GENERIC", "") not in ("", "0")
HAS_F16C = target_has("f16c")
# decode attention's inner loops as IR (attn_avx2) where the target has them, else the numba loops below
VECTOR_ATTN = HAS_F16C and target_has("avx2") and target_has("fma") and not GENERIC_FORCED
h2f = h2f_hw if HAS_F16C else h2f_soft
f2h = f2h_hw if HAS_F16C else f32_to_f16_bits


@njit(cache=True, nogil=True)
def store_f16(cache_l, x3, pos0):
    """cache_l (cap, n_kv, hd) uint16 (f16 bits) [pos0 : pos0+T] <- x3 (T, n_kv, hd) f32 (f2h: vcvtps2ph
    with F16C, 8 values per instruction; the bit-by-bit conversion cost ~0.4 us per decode token and layer)."""
    for t in range(x3.shape[0]):
        for h in range(x3.shape[1]):
            for j in range(x3.shape[2]):
                cache_l[pos0 + t, h, j] = f2h(x3[t, h, j])


# ------------------------------------------------------------------------------------- f16 attention
@njit(cache=True, nogil=True, fastmath=True, inline="always")
def _dot_f16(qv, kr):
    """qv (hd,) f32 . kr (hd,) f16 bits: one position's score, for the tails of the blocked loops."""
    a = F32(0.0)
    for j in range(qv.shape[0]):
        a += qv[j] * h2f(kr[j])
    return a


@njit(cache=True, nogil=True, fastmath=True, inline="always")
def _dot_q8(qv, kr, ksr):
    """qv (hd,) f32 . dequant(kr (hd,) int8, ksr (hd // gs,) f32): one position's score over an int8 cache
    (the IR item's last 1-3 positions)."""
    gs = qv.shape[0] // ksr.shape[0]
    a = F32(0.0)
    for gi in range(ksr.shape[0]):
        part = F32(0.0)
        for j in range(gi * gs, (gi + 1) * gs):
            part += qv[j] * F32(kr[j])
        a += part * ksr[gi]
    return a


@njit(cache=True, nogil=True, fastmath=True, inline="always")
def _scores_loops(s, qg, kc, kh, lo, hi, scale):
    """s[g, p - lo] <- scale * qg[g] . K[p, kh] for lo <= p < hi; qg (group, hd) f32, kc (cap, n_kv, hd)
    f16 bits. Four positions per pass: one loop setup and one q load serve four dot products; the heads
    of the group reuse the four rows from L1."""
    group, hd = qg.shape
    p = lo
    while p + 4 <= hi:
        k0, k1, k2, k3 = kc[p, kh], kc[p + 1, kh], kc[p + 2, kh], kc[p + 3, kh]
        for g in range(group):
            qv = qg[g]
            a0 = F32(0.0)
            a1 = F32(0.0)
            a2 = F32(0.0)
            a3 = F32(0.0)
            for j in range(hd):
                qj = qv[j]
                a0 += qj * h2f(k0[j])
                a1 += qj * h2f(k1[j])
                a2 += qj * h2f(k2[j])
                a3 += qj * h2f(k3[j])
            sg = s[g]
            sg[p - lo] = a0 * scale
            sg[p + 1 - lo] = a1 * scale
            sg[p + 2 - lo] = a2 * scale
            sg[p + 3 - lo] = a3 * scale
        p += 4
    while p < hi:
        kr = kc[p, kh]
        for g in range(group):
            s[g, p - lo] = _dot_f16(qg[g], kr) * scale
        p += 1


@njit(cache=True, nogil=True, fastmath=True, inline="always")
def _weighted_sum_loops(acc, s, vc, kh, lo, hi):
    """acc[g, :hd] += sum over lo <= p < hi of s[g, p - lo] * V[p, kh]; four positions per load/store of
    the accumulator row."""
    group = s.shape[0]
    hd = vc.shape[2]
    p = lo
    while p + 4 <= hi:
        v0, v1, v2, v3 = vc[p, kh], vc[p + 1, kh], vc[p + 2, kh], vc[p + 3, kh]
        for g in range(group):
            sg, ag = s[g], acc[g]
            w0, w1, w2, w3 = sg[p - lo], sg[p + 1 - lo], sg[p + 2 - lo], sg[p + 3 - lo]
            for j in range(hd):
                ag[j] += (w0 * h2f(v0[j]) + w1 * h2f(v1[j])) + (w2 * h2f(v2[j]) + w3 * h2f(v3[j]))
        p += 4
    while p < hi:
        vr = vc[p, kh]
        for g in range(group):
            w = s[g, p - lo]
            ag = acc[g]
            for j in range(hd):
                ag[j] += w * h2f(vr[j])
        p += 1


@njit(cache=True, nogil=True, fastmath=True, inline="always")
def _softmax_rows_vec(pc, s, n):
    """_softmax_rows through the IR kernel (attn_softmax: every score in vectors, a masked rest)."""
    hd = pc.shape[1] - 2
    for g in range(s.shape[0]):
        m, tot = softmax_row(s[g], n)
        pc[g, hd] = m
        pc[g, hd + 1] = tot


@njit(cache=True, nogil=True, fastmath=True, inline="always")
def _softmax_rows_loops(pc, s, n):
    """s[g, :n] <- exp(s[g, :n] - max) in place; pc[g, hd] <- max, pc[g, hd + 1] <- sum, for every head g."""
    hd = pc.shape[1] - 2
    for g in range(s.shape[0]):
        sg = s[g]
        m = F32(-np.inf)
        for p in range(n):
            m = max(m, sg[p])
        tot = F32(0.0)
        for p in range(n):
            e = exp_fast(sg[p] - m)
            sg[p] = e
            tot += e
        pc[g, hd] = m
        pc[g, hd + 1] = tot


_softmax_rows = _softmax_rows_vec if VECTOR_ATTN else _softmax_rows_loops


def chunk_cap(capacity: int) -> int:
    """The most positions a work item covers over a cache of this capacity (the scores scratch's width)."""
    return (capacity + SPLITS - 1) // SPLITS


@njit(cache=True, nogil=True, inline="always")
def _work_item(it, pos0):
    """Work item it -> (row t, chunk c, positions lo:hi). Chunks depend only on the row's own length
    pos0 + t + 1, so a row of a T-row pass is computed exactly like a one-row step. An item covers every
    KV head: the cache rows of its positions (all heads side by side) are read as one stream, which
    measured 14% faster in the step than an item per (head, chunk) at 600 context (scripts/step_phases.py)."""
    t, c = it // SPLITS, it % SPLITS
    n_see = pos0 + t + 1
    step = (n_see + SPLITS - 1) // SPLITS
    return t, c, c * step, min(n_see, (c + 1) * step)


@njit(cache=True, nogil=True, inline="always")
def _clear_part(pc):
    """pc (group, hd + 2) <- empty chunk: zero V sum, max -inf, sum 0 (the merge skips it)."""
    hd = pc.shape[1] - 2
    for g in range(pc.shape[0]):
        for j in range(hd + 2):
            pc[g, j] = F32(0.0)
        pc[g, hd] = F32(-np.inf)


@njit(cache=True, nogil=True, fastmath=True, inline="always")
def _merge_parts(out, part):
    """out (T, H, hd) <- the chunks of part (T, n_kv, SPLITS, group, hd + 2) rescaled to a common max."""
    t_n, n_kv, n_split, group, hd2 = part.shape
    hd = hd2 - 2
    for t in range(t_n):
        for kh in range(n_kv):
            for gi in range(group):
                m = F32(-np.inf)
                for c in range(n_split):
                    m = max(m, part[t, kh, c, gi, hd])
                tot = F32(0.0)
                o = out[t, kh * group + gi]
                for j in range(hd):
                    o[j] = F32(0.0)
                for c in range(n_split):
                    if part[t, kh, c, gi, hd + 1] > 0:
                        f = exp_fast(part[t, kh, c, gi, hd] - m)
                        tot += f * part[t, kh, c, gi, hd + 1]
                        for j in range(hd):
                            o[j] += f * part[t, kh, c, gi, j]
                inv = F32(1.0) / tot
                for j in range(hd):
                    o[j] *= inv


@njit(cache=True, nogil=True, fastmath=True, inline="always")
def _item_heads_loops(part, sc, qt, kv, t, c, lo, hi, scale):
    """Positions lo:hi of every head of row t (qt (H, hd)) into part[t, :, c] over an f16 cache kv = (kc,
    vc), one KV head after the other, with the numba loops. sc (H, >= hi - lo) f32 scores."""
    kc, vc = kv
    n_kv = kc.shape[1]
    group = qt.shape[0] // n_kv
    for kh in range(n_kv):
        pc, sg = part[t, kh, c], sc[kh * group:(kh + 1) * group]
        _scores_loops(sg, qt[kh * group:(kh + 1) * group], kc, kh, lo, hi, scale)
        _softmax_rows(pc, sg, hi - lo)
        _weighted_sum_loops(pc, sg, vc, kh, lo, hi)


# The IR kernels of the positions-outer item, by cache: kv = (kc, vc) f16 bits (attn_avx2), or
# (kq, ks, vq, vs) int8 values and their group scales (attn_int8_avx2, scale groups of 8k values); the overloads
# tell them apart by attn_fetch.is_f16.
def _kdot8(kv, sc, o, qt, p, group, scale, ahead):
    """sc[h, o:o + 8] <- scale * qt[h] . K[p:p + 8, h // group] for every head h; an f16 cache's kernels ask for
    the lines of the row at address `ahead` (and the 7 after it) as they read rows p:p + 8 (numba only, see the
    overload)."""
    raise NotImplementedError


def _kdot4(kv, sc, o, qt, p, group, scale, ahead):
    """sc[h, o:o + 4] <- scale * qt[h] . K[p:p + 4, h // group] for every head h, asking as _kdot8 does (numba
    only, see the overload)."""
    raise NotImplementedError


def _dot1(kv, q, p, kh):
    """q . K[p, kh] (numba only, see the overload)."""
    raise NotImplementedError


def _vsum(kv, pt, sc, o, n, p, group, ahead):
    """pt[h // group, h % group, :hd] += sum over i < n of sc[h, o + i] * V[p + i, h // group] for every head h
    (pt: a work item's part rows, (n_kv, group, hd + 2)); an f16 cache's kernels ask for the lines of the rows
    from address `ahead` as they read rows p:p + n (numba only, see the overload)."""
    raise NotImplementedError


def _kdot_by_cache(kdot_f16, kdot_f16_heads, kdot_f16_pairs, kdot_q8, kdot_q8_heads, kdot_q8_pairs):
    """The overload of _kdot8 / _kdot4: the IR kdot of R positions for the cache's type, every head of sc
    and qt (H rows; heads h share KV head h // group). Where the groups come in threes, the grouped forms
    (one K conversion for GROUP_HEADS heads, the same bits); in twos or fours, the pair forms:
    one layer's call at 1024 positions, qwen3-1.7b's shapes (group 2) 156 -> 124 us cache-hot, 306 -> 276
    from DRAM; qwen3-4b's (group 4) 265 -> 191 / 443 -> 358 (bench/results-models.md Run 7)."""
    def impl(kv, sc, o, qt, p, group, scale, ahead):
        if is_f16(kv):
            def f16(kv, sc, o, qt, p, group, scale, ahead):
                if group % GROUP_HEADS == 0:
                    for h in range(0, qt.shape[0], GROUP_HEADS):
                        kdot_f16_heads(sc[h:h + GROUP_HEADS], o, qt[h:h + GROUP_HEADS], kv[0], p, h // group,
                                       scale, ahead)
                elif group % 2 == 0:
                    for h in range(0, qt.shape[0], 2):
                        kdot_f16_pairs(sc[h:h + 2], o, qt[h:h + 2], kv[0], p, h // group, scale, ahead)
                else:
                    for h in range(qt.shape[0]):
                        kdot_f16(sc[h], o, qt[h], kv[0], p, h // group, scale, ahead)
            return f16

        def int8(kv, sc, o, qt, p, group, scale, ahead):
            if group % GROUP_HEADS == 0:
                for h in range(0, qt.shape[0], GROUP_HEADS):
                    kdot_q8_heads(sc[h:h + GROUP_HEADS], o, qt[h:h + GROUP_HEADS], kv[0], kv[1], p, h // group,
                                  scale)
            elif group % 2 == 0:
                for h in range(0, qt.shape[0], 2):
                    kdot_q8_pairs(sc[h:h + 2], o, qt[h:h + 2], kv[0], kv[1], p, h // group, scale)
            else:
                for h in range(qt.shape[0]):
                    kdot_q8(sc[h], o, qt[h], kv[0], kv[1], p, h // group, scale)
        return int8
    return impl


overload(_kdot8, inline="always")(_kdot_by_cache(kdot8, kdot8_heads, kdot8_pairs, kdot8_q8, kdot8_q8_heads,
                                                  kdot8_q8_pairs))
overload(_kdot4, inline="always")(_kdot_by_cache(kdot4, kdot4_heads, kdot4_pairs, kdot4_q8, kdot4_q8_heads,
                                                  kdot4_q8_pairs))


@overload(_dot1, inline="always")
def _dot1_impl(kv, q, p, kh):
    if is_f16(kv):
        def f16(kv, q, p, kh):
            return _dot_f16(q, kv[0][p, kh])
        return f16

    def int8(kv, q, p, kh):
        return _dot_q8(q, kv[0][p, kh], kv[1][p, kh])
    return int8


@overload(_vsum, inline="always")
def _vsum_impl(kv, pt, sc, o, n, p, group, ahead):
    if is_f16(kv):
        def f16(kv, pt, sc, o, n, p, group, ahead):
            if group % GROUP_HEADS == 0:
                for h in range(0, sc.shape[0], GROUP_HEADS):
                    g = h % group
                    vsum_heads(pt[h // group, g:g + GROUP_HEADS], sc[h:h + GROUP_HEADS], o, n, kv[1], p, h // group,
                               ahead)
            elif group % 2 == 0:
                for h in range(0, sc.shape[0], 2):
                    g = h % group
                    vsum_pairs(pt[h // group, g:g + 2], sc[h:h + 2], o, n, kv[1], p, h // group, ahead)
            else:
                for h in range(sc.shape[0]):
                    vsum(pt[h // group, h % group], sc[h], o, n, kv[1], p, h // group, ahead)
        return f16

    def int8(kv, pt, sc, o, n, p, group, ahead):
        if group % GROUP_HEADS == 0:
            for h in range(0, sc.shape[0], GROUP_HEADS):
                g = h % group
                vsum_q8_heads(pt[h // group, g:g + GROUP_HEADS], sc[h:h + GROUP_HEADS], o, n, kv[2], kv[3], p,
                              h // group, ahead)
        elif group % 2 == 0:
            for h in range(0, sc.shape[0], 2):
                g = h % group
                vsum_q8_pairs(pt[h // group, g:g + 2], sc[h:h + 2], o, n, kv[2], kv[3], p, h // group, ahead)
        else:
            for h in range(sc.shape[0]):
                vsum_q8(pt[h // group, h % group], sc[h], o, n, kv[2], kv[3], p, h // group, ahead)
    return int8


@njit(cache=True, nogil=True, fastmath=True, inline="always")
def _item_heads_vec(part, sc, qt, kv, t, c, lo, hi, scale):
    """_item_heads_loops' contract through the IR kernels, over an f16 or int8 cache kv (see _f16),
    positions outer: 8 positions' K rows (every head, one contiguous block of the cache) serve every
    head's scores before the next 8 are read, and the weighted V sums run over V_BLOCK positions at a time
    for every head (the query heads of a KV head three at a time where the groups come in threes: each K
    and V vector converted once for them). One head after the other instead read each head's part of the
    rows in a pass of its own, a strided stream per head from DRAM."""
    n_head = qt.shape[0]
    n_kv = kv[0].shape[1]
    group = n_head // n_kv
    p = lo
    fetch_kv(kv, lo, min(hi, lo + first_rows(kv)), lo, lo)  # the item's first rows, before it asks as it reads
    while p + 8 <= hi:
        burst_k_ahead(kv, p, hi)
        _kdot8(kv, sc, p - lo, qt, p, group, scale, k_ahead(kv, p, lo, hi))
        p += 8
    if p + 4 <= hi:
        _kdot4(kv, sc, p - lo, qt, p, group, scale, k_ahead(kv, p, lo, hi))
        p += 4
    while p < hi:
        for h in range(n_head):
            sc[h, p - lo] = _dot1(kv, qt[h], p, h // group) * scale
        p += 1
    softmax_and_sums(part, sc, kv, t, c, lo, hi, n_head, group)


@njit(cache=True, nogil=True, fastmath=True, inline="always")
def softmax_and_sums(part, sc, kv, t, c, lo, hi, n_head, group):
    """A work item's scores sc[:, :hi - lo] -> part[t, :, c]: each KV head's softmax, then the weighted V sums
    over V_BLOCK positions at a time for every head, asking for each V line ROWS_AHEAD positions on as they read
    one (attn_fetch.v_ahead); an int8 cache's first block of V rows in a burst (its scores do not run on into them) and
    each next block's scale rows while the sums of the block before it run. Every item form shares it
    (attn_int8's too)."""
    burst_kv(kv, hi, hi, lo, min(hi, lo + V_BLOCK))
    for kh in range(kv[0].shape[1]):
        _softmax_rows(part[t, kh, c], sc[kh * group:(kh + 1) * group], hi - lo)
    for b in range(lo, hi, V_BLOCK):
        burst_v_scales(kv, min(hi, b + V_BLOCK), min(hi, b + 2 * V_BLOCK))
        _vsum(kv, part[t, :, c], sc[:n_head], b - lo, min(V_BLOCK, hi - b), b, group, v_ahead(kv, b, hi))


_item_heads = _item_heads_vec if VECTOR_ATTN else _item_heads_loops


@njit(cache=True, nogil=True, fastmath=True)
def attn_item_f16(part, sc, q, kc, vc, it, pos0, scale):
    """Work item it (row t, chunk c; _work_item) of f16 attention into part[t, kh, c] (group, hd + 2) for
    every KV head kh: [0:hd] weighted V sum, [hd] max, [hd + 1] sum of the chunk. sc (H, >= chunk) f32
    scores. A function of its own (not inlined) so that every caller runs it under the same fastmath flags:
    attention_f16_split and the one-region fused step (step) give bit-identical rows."""
    t, c, lo, hi = _work_item(it, pos0)
    for kh in range(kc.shape[1]):
        _clear_part(part[t, kh, c])
    if lo < hi:
        _item_heads(part, sc, q[t], (kc, vc), t, c, lo, hi, scale)


@njit(cache=True, nogil=True, fastmath=True)
def merge_parts(out, part):
    """_merge_parts as a function of its own (same flags for every caller, see attn_item_f16)."""
    _merge_parts(out, part)


@njit(cache=True, nogil=True)
def attention_f16_part(lo, hi, part, sc, q, kc, vc, pos0, scale):
    """Work items lo..hi of attention_f16_split into part, on the calling thread with scores scratch sc
    (group, cap); merge_parts finishes once every item is done. For the start-up step (see
    fast.mm_q4x3_part)."""
    for it in range(lo, hi):
        attn_item_f16(part, sc, q, kc, vc, it, pos0, scale)


@njit(cache=True, nogil=True, parallel=True, fastmath=True)
def attention_f16_split(out, q, kc, vc, pos0, scale, sbuf, part):
    """out (T, H, hd) <- causal GQA attention over kc, vc (cap, n_kv, hd) uint16 f16 bits, each row split
    over positions ("flash decoding"): KV heads alone are too little parallel work for 2 threads in
    decode (3 heads -> a 2:1 split). Work item (t, chunk) keeps each head's max, sum and weighted V sum in
    part (T, n_kv, SPLITS, group, hd + 2); a merge per row rescales them into out. sbuf (threads, H,
    >= chunk_cap(cap)) f32 holds a work item's scores. Row t is computed exactly as a one-row call at pos0 + t
    would (chunks depend only on its own length): a verify pass over T drafted tokens gives bit-identical
    rows to T decode steps, which lossless speculation needs."""
    t_n = q.shape[0]
    for it in prange(t_n * SPLITS):
        attn_item_f16(part, sbuf[numba.get_thread_id()], q, kc, vc, np.int64(it), pos0, scale)
    merge_parts(out, part[:t_n])  # part has rows for the largest T seen; only t_n are filled
