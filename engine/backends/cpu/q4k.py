"""Q4_K matrices in the 'q4k' layout (layout.py): fast.py's 4-bit kernels over blocks that keep the file's 6-bit
scales, so a decode step streams 592 bytes per block of a 32-row group instead of the 640 of the Q4_1 blocks that
Q4_K took before (kquant.q4k_as_q41, still the tests' reference).

Same contract as fast.py's 'q4' kernels and the same bits: a block's d and m are f16(d_sb sc) and
f16(-(dmin_sb mn)), the values q4k_as_q41 rounded once in numpy, formed here per block (avx2.Blocks4K: vcvtps2ph
in the AVX2 forms, layout.f2h in the generic ones), then the same integer sums and _q4_term in the same order.
The forms are fast's: the decode form with the group's outputs in registers (avx2.grp_q4k: a super-block's
header converted once for its 8 blocks, avx2.Blocks4K.each), up to ROWS_DIRECT rows four at a time
(grp_q4k_rows*), more over the group written out once as 'q4' blocks (avx2.expand_q4k) for fast's multi-row
form (forming the scales in every call of four rows cost a T = 64 matmul ~20%), and past ROWS_UNPACKED_Q4 rows
(targets without AVX512-VNNI) each block unpacked once (unpack_q4k, fast's blk_q4u). A weight is
fast.FastWeight kind 'q4k': blocks (ng, nsb, SB4K), or (P, ng / P, nsb, SB4K) in prepare_layers' per-thread
parts.
Measured (probes/layout_bytes.py, 8192x2048, two threads, 600 MB of matrices swept from DRAM, the AVX-512 Xeon
guest, 2026-12-06): us per matrix 'q4' -> 'q4k' at T = 1 399 -> 350, T = 4 574 -> 519, T = 8 804 -> 768,
T = 16 1244 -> 1275, T = 64 4069 -> 3837; models: bench/results-models.md ("The 'q4k' layout").
"""
from __future__ import annotations

from ... import numba_env  # noqa: F401  (must precede the numba import: SLP flag, cache dir, threading layer)

import numpy as np
from numba import njit, prange

from ...quant import QK
from . import avx2, fast
from .attn import h2f
from .fast import HAVE_AVX2, ROWS_UNPACKED_Q4, XS, XS_A, _batched_target, _copy_partial, _q4_term
from .layout import G, K_BLK, K_HDR, K_MN, K_SC, f2h, nib_at

F32 = np.float32
I32 = np.int32
# Up to this many activation rows the multi-row form reads the 'q4k' blocks themselves (up to four calls of four
# rows a group); more run on the group expanded to 'q4' blocks once (group_avx2). probes/layout_bytes.py's
# harness run per T (8192x2048, two threads, from DRAM), us per matrix direct / expanded: T = 12 964-991 /
# 1119-1121, T = 16 1205-1293 / 1242-1366, T = 24 and 32 the same, T = 64 4644-4890 / 3974-4081.
ROWS_DIRECT = 16


@njit(cache=True, nogil=True, inline="always")
def n_blocks(blk):
    """Blocks of 32 values per row of a 'q4k' weight (its super-blocks hold 8)."""
    return blk.shape[-2] * 8


@njit(cache=True, nogil=True, inline="always")
def _byte(blk, g, b, i):
    # byte i of block b of group g
    return blk[g, b // 8, K_HDR + (b % 8) * K_BLK + i]


@njit(cache=True, nogil=True, inline="always")
def _hdr(blk, g, b, i):
    # the f16 at bytes i, i + 1 of block b's super-block header, as f32
    lo, hi = np.uint16(blk[g, b // 8, i]), np.uint16(blk[g, b // 8, i + 1])
    return h2f(np.uint16(lo | np.uint16(hi << np.uint16(8))))


@njit(cache=True, nogil=True, inline="always")
def dm_bits(blk, g, b, r):
    """(d, m) f16 bits of row r of block b of group g: f16(d sc), f16(-(dmin mn))."""
    d = f2h(_hdr(blk, g, b, 2 * r) * F32(_byte(blk, g, b, K_SC + r)))
    return d, f2h(-(_hdr(blk, g, b, 2 * (G + r)) * F32(_byte(blk, g, b, K_MN + r))))


@njit(cache=True, nogil=True)
def group_generic(out, qa, sa, xs, blk, g):
    """Rows g*G .. g*G+G-1 of out (T, rows) <- x @ W^T for a 'q4k' W: the sums of fast._q4_rows, _q4_term with
    dm_bits (the kernels of hosts without AVX2, and the tests' reference)."""
    n = min(G, out.shape[1] - g * G)
    acc = np.zeros(G, I32)
    o = np.zeros(G, F32)
    for t in range(out.shape[0]):
        o[:] = 0.0
        for b in range(n_blocks(blk)):
            acc[:] = 0
            for j in range(QK):
                a = I32(qa[t, b * QK + j])
                k, e = j // 4, j % 4
                for r in range(G):
                    h, sh, r8 = r // 16, 4 * ((r % 16) // 8), r % 8
                    q = (I32(_byte(blk, g, b, nib_at(2 * k + h, 4 * r8 + e))) >> sh) & 15
                    acc[r] += (q - 8) * a
            for r in range(G):
                d, m = dm_bits(blk, g, b, r)
                o[r] += _q4_term(d, m, sa[t, b], xs[t, XS * b], acc[r])
        for r in range(n):
            out[t, g * G + r] = o[r]


@njit(cache=True, nogil=True, inline="always")
def _grp(o, o0, qa, sa, xs, blk, g, t):
    # o[o0 : o0 + G] (flat) <- all blocks of group g for activation row t (avx2.grp_q4k)
    avx2.grp_q4k(o, o0, blk, g * blk.strides[0], qa, t * qa.strides[0], sa, xs, t * (sa.strides[0] // 4),
                 t * (xs.strides[0] // 4), n_blocks(blk))


@njit(cache=True, nogil=True, inline="always")
def _grp_rows(o, o0, o_st, qa, sa, xs, blk, g, t, n):
    # rows t .. t + n - 1 (n <= avx2.ROWS_MAX) of o (flat offsets o0 + i o_st) <- all blocks of group g
    a0, ast = t * qa.strides[0], qa.strides[0]
    s0, sst = t * (sa.strides[0] // 4), sa.strides[0] // 4
    x0, xst = t * (xs.strides[0] // 4), xs.strides[0] // 4
    bo, nb = g * blk.strides[0], n_blocks(blk)
    if n == 4:
        avx2.grp_q4k_rows4(o, o0, o_st, blk, bo, qa, a0, ast, sa, xs, s0, sst, x0, xst, nb)
    elif n == 3:
        avx2.grp_q4k_rows3(o, o0, o_st, blk, bo, qa, a0, ast, sa, xs, s0, sst, x0, xst, nb)
    elif n == 2:
        avx2.grp_q4k_rows2(o, o0, o_st, blk, bo, qa, a0, ast, sa, xs, s0, sst, x0, xst, nb)
    else:
        avx2.grp_q4k_rows1(o, o0, o_st, blk, bo, qa, a0, ast, sa, xs, s0, sst, x0, xst, nb)


@njit(cache=True, nogil=True)
def group_unpacked(out, qa, sa, xs, blk, g):
    """fast.q4_group_batched_avx2's unpacked form (more than ROWS_UNPACKED_Q4 rows): each block unpacked once
    (avx2.unpack_q4k) and every activation row summed on it (avx2.blk_q4u)."""
    t_n = out.shape[0]
    full, part = _batched_target(out, g)
    buf = np.empty(avx2.UNBUF, np.uint8)
    for b in range(n_blocks(blk)):
        avx2.unpack_q4k(buf, blk, g * blk.strides[0], b)
        for t in range(t_n):
            if full:
                avx2.blk_q4u(out, (t * out.strides[0]) // 4 + g * G, buf, qa, t * qa.strides[0] + b * QK,
                             sa[t, b], xs[t, XS * b], xs[t, XS * b + XS_A])
            else:
                avx2.blk_q4u(part, t * G, buf, qa, t * qa.strides[0] + b * QK, sa[t, b], xs[t, XS * b],
                             xs[t, XS * b + XS_A])
    if not full:
        for t in range(t_n):
            _copy_partial(out, part[t], t, g)


@njit(cache=True, nogil=True)
def group_avx2(out, qa, sa, xs, blk, g):
    """Rows g*G .. of out (T, rows) for a 'q4k' W with the AVX2 forms (fast.q4_group_batched_avx2's choice by
    T); bit-identical to group_generic. More than ROWS_DIRECT rows run fast's multi-row form on the group
    written out in the 'q4' layout once (avx2.expand_q4k)."""
    t_n = out.shape[0]
    if t_n > ROWS_UNPACKED_Q4:
        group_unpacked(out, qa, sa, xs, blk, g)
        return
    if t_n > ROWS_DIRECT:
        nb = n_blocks(blk)
        q4 = np.empty((1, nb, avx2.BLK4), np.uint8)
        avx2.expand_q4k(q4, blk, g * blk.strides[0], nb)
        fast.q4_group_batched(out[:, g * G:], qa, sa, xs, q4, 0)
        return
    if (g + 1) * G <= out.shape[1]:
        for t in range(0, t_n, avx2.ROWS_MAX):
            _grp_rows(out, (t * out.strides[0]) // 4 + g * G, out.strides[0] // 4, qa, sa, xs, blk, g, t,
                      min(avx2.ROWS_MAX, t_n - t))
        return
    part = np.zeros((t_n, G), np.float32)  # the last group of a padded weight
    for t in range(0, t_n, avx2.ROWS_MAX):
        _grp_rows(part, t * G, G, qa, sa, xs, blk, g, t, min(avx2.ROWS_MAX, t_n - t))
    for t in range(t_n):
        _copy_partial(out, part[t], t, g)


group = group_avx2 if HAVE_AVX2 else group_generic


@njit(cache=True, nogil=True, inline="always")
def item(out, qa, sa, xs, blk, j, g):
    """Group j of blk into rows g * G.. of out (g = j unless blk is one part of a matrix), as fast._q4: a
    decode row's full group runs the decode form in the caller's code."""
    if HAVE_AVX2 and out.shape[0] == 1 and (g + 1) * G <= out.shape[1]:
        _grp(out, g * G, qa, sa, xs, blk, j, 0)
    else:
        group(out[:, (g - j) * G:], qa, sa, xs, blk, j)


@njit(cache=True, nogil=True, parallel=True)
def mm(out, qa, sa, xs, blk):
    """out (T, rows) f32 <- x @ W^T for a 'q4k' W (ng, nsb, SB4K); x as fast.quantize_rows gives it."""
    for g in prange(blk.shape[0]):
        item(out, qa, sa, xs, blk, np.int64(g), np.int64(g))


@njit(cache=True, nogil=True, parallel=True)
def mm_parts(out, qa, sa, xs, blk):
    """mm for a layer matrix in parts (P, ng / P, nsb, SB4K: fast.prepare_layers)."""
    h = blk.shape[1]
    for i in prange(blk.shape[0] * h):
        g = np.int64(i)
        item(out, qa, sa, xs, blk[g // h], g % h, g)


@njit(cache=True, nogil=True)
def mm_part(lo, hi, out, qa, sa, xs, blk):
    """Groups lo..hi of mm_parts on the calling thread (the cold start's kernel-by-kernel step: tier.py)."""
    h = blk.shape[1]
    for g in range(lo, hi):
        item(out, qa, sa, xs, blk[g // h], g % h, g)


def matmul(out, qa, sa, xs, blocks) -> None:
    """out (T, rows) <- x @ W^T for a 'q4k' FastWeight's blocks (3-D, or 4-D in parts)."""
    (mm_parts if blocks.ndim == 4 else mm)(out, qa, sa, xs, blocks)


@njit(cache=True, nogil=True)
def embed(out, blk, tokens):
    """out (T, n) <- rows tokens (T,) of a 'q4k' table: d q + m with the f16 d and m (fast.embed_q4's values for
    the same file)."""
    for t in range(tokens.shape[0]):
        g, rg = tokens[t] // G, tokens[t] % G
        h, r8, shift = rg // 16, rg % 8, 4 * ((rg % 16) // 8)
        for b in range(n_blocks(blk)):
            d, m = dm_bits(blk, g, b, rg)
            dv, mv = h2f(d), h2f(m)
            for j in range(QK):
                q = (I32(_byte(blk, g, b, nib_at(2 * (j // 4) + h, 4 * r8 + j % 4))) >> shift) & 15
                out[t, b * QK + j] = dv * F32(q) + mv
