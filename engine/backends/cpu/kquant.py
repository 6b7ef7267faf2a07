"""The K-quants (Q4_K, Q5_K, Q6_K) and Q5_0 / Q5_1 on the fast CPU path: fast.py's contract (int8 activations
with one scale per 32 values, integer block dot products, a row of a T-row call bit-identical to a one-row
call), so the Q4_K_M / Q5_K_M / Q6_K files users download do not fall back to kernels.py's float kernels.

Q4_K -> fast's 'q4k' layout (q4k.py): a Q4_K sub-block j of 32 values, y = d sc_j q - dmin mn_j, IS a Q4_1
block with scale d sc_j and min -dmin mn_j; the layout keeps the 6-bit sc_j and mn_j and the kernels round
those two to f16 once, the values of the Q4_1 blocks it was written as before (q4k_as_q41, the tests'
reference), on 592 bytes per block of a 32-row group instead of 640.
Q5_0, Q5_1, Q5_K -> the 5-bit layout "q5" (kquant_avx2's docstring: fast's 4-bit block plus a plane of high
bits, f16 d and m per row and 32 values; y = d q + m): Q5_1 as it is, Q5_K as Q4_K (d sc_j and -dmin mn_j
rounded to f16), Q5_0 without m (704 bytes a block, BLK5Z: m = -16 d, which the kernels take as m + 16 d = 0,
the value a stored m gave; 768 with it).
Q6_K -> the 6-bit layout "q6": the 4-bit block plus a plane of 2-bit fields and the int8 scale of each 16
values, in super-blocks of 8 blocks after the rows' f16 d (the file's, one per 256 values), exact (y = d sc
(q - 32), integers times d as llama.cpp does).
The f16 rounding of Q4_K / Q5_K scales and mins is far below the activations' int8 rounding (relative rms
error they add to a matmul ~0.1 of the activations'; KL divergence of SmolLM2's Q4_K_M vs the exact scales
1e-6 against 3e-3 in all: bench/results-kquant.md, probes/kquant_error.py).
Why planes rather than a byte per value: the bytes (5.5-7 bits a value, the file's) are what a decode step
streams; a byte layout (8 bits + scales, 9-10) measured ~1.6-2x slower per matrix streamed on the 2-core dev
VM and caps the GGUF-bytes roofline at 60-70%; merging the bits costs 2-3 vector ops per 32 values.
Weights of the q5 / q6 layouts are KWeight, not fast.FastWeight; the fused step takes them as stacks of their
own (step_weights.py) and runs `group` per row group (step_mm.py), as the plain walk's `mm` does.
"""
from __future__ import annotations

from ... import numba_env  # noqa: F401  (must precede the numba import: SLP flag, cache dir, threading layer)

import numpy as np
from numba import njit, prange

from ...gguf_types import GGMLQuantizationType as QT
from ...quant import QK, QTensor, _q4k_scales, _q5_values
from . import kquant_avx2 as kx
from .avx2 import XS, XS_A, XS_A0
from .attn import GENERIC_FORCED, h2f
from .layout import G, nib_at
from .target import target_has

HAVE_AVX2 = target_has("avx2") and target_has("f16c") and not GENERIC_FORCED
P_OFF, Q5_D, Q5_M, BLK5, BLK5Z = kx.P_OFF, kx.Q5_D, kx.Q5_M, kx.BLK5, kx.BLK5Z
Q6_SC0, Q6_SC1, K6_BLK, K6_HDR, SB6 = kx.Q6_SC0, kx.Q6_SC1, kx.K6_BLK, kx.K6_HDR, kx.SB6
BITS = {QT.Q5_0: 5, QT.Q5_1: 5, QT.Q5_K: 5, QT.Q6_K: 6}  # the layouts of kquant_avx2
QTYPES = (QT.Q4_K, *BITS)  # what prepare_weight takes
CHUNK_ROWS = 64 * G  # rows decoded at a time while packing (bounds the temporaries of a large matrix)
F32 = np.float32
I32 = np.int32


class KWeight:
    """A Q5_0/Q5_1/Q5_K (bits 5) or Q6_K (bits 6) matrix in kquant_avx2's layout: blocks uint8 (ng, nb, BLK5)
    (Q5_0: BLK5Z, no m) or (ng, nb / 8, SB6) (q6 super-blocks), ng = ceil(rows / G), nb = cols / 32
    (n_blocks)."""

    def __init__(self, name, qtype, shape, blocks):
        self.name, self.qtype, self.shape, self.blocks = name, qtype, shape, blocks
        self.bits = BITS[qtype]


# ------------------------------------------------------------------------------------ K-quant scales -> f16
def _k_rounded(blk: np.ndarray):
    """Super-blocks (rows, nsb, B) of Q4_K / Q5_K -> (d, m) f16 (rows, nsb * 8): f16(d sc_j), f16(-dmin mn_j);
    None when one overflows f16."""
    rows, nsb = blk.shape[:2]
    hv = blk[..., 0:4].copy().view(np.float16).astype(F32)  # (rows, nsb, 2): d, dmin
    sc, mn = _q4k_scales(blk[..., 4:16].reshape(-1, 12))
    with np.errstate(over="ignore"):
        d = (hv[..., 0:1] * sc.reshape(rows, nsb, 8)).astype(np.float16)  # exact f32 products, rounded once
        m = (-(hv[..., 1:2] * mn.reshape(rows, nsb, 8))).astype(np.float16)
    if not (np.isfinite(d).all() and np.isfinite(m).all()):
        return None
    return d.reshape(rows, nsb * 8), m.reshape(rows, nsb * 8)


def q4k_scale_bytes(raw: np.ndarray):
    """Q4_K blocks raw (rows, n / 256 * 144) uint8 -> (sc, mn) (rows, n / 32) uint8: each sub-block's 6-bit
    scale and min (the 'q4k' layout keeps them); None when f16(d sc) or f16(-dmin mn) does not fit f16."""
    rows = raw.shape[0]
    blk = np.ascontiguousarray(raw).reshape(rows, -1, 144)
    if _k_rounded(blk) is None:
        return None
    sc, mn = _q4k_scales(blk[..., 4:16].reshape(-1, 12))
    return sc.astype(np.uint8).reshape(rows, -1), mn.astype(np.uint8).reshape(rows, -1)


def q4k_as_q41(raw: np.ndarray):
    """Q4_K blocks raw (rows, n / 256 * 144) uint8 -> the same values as Q4_1 blocks (rows, n / 32 * 20):
    per 32-value sub-block f16(d sc_j), f16(-dmin mn_j) and its 16 nibble bytes (value v in byte v % 16,
    the high nibble for v >= 16). None when a scale or min does not fit f16."""
    rows = raw.shape[0]
    blk = np.ascontiguousarray(raw).reshape(rows, -1, 144)
    dm = _k_rounded(blk)
    if dm is None:
        return None
    out = np.empty((rows, dm[0].shape[1], 20), np.uint8)
    out[..., 0:2] = dm[0].view(np.uint8).reshape(rows, -1, 2)
    out[..., 2:4] = dm[1].view(np.uint8).reshape(rows, -1, 2)
    _q4k_nibbles(out.reshape(rows, -1), blk.reshape(rows, -1))
    return out.reshape(rows, -1)


@njit(cache=True, nogil=True)
def _q4k_nibbles(out, raw):
    # chunk c of a super-block (its bytes 16 + 32c ..): sub-block 2c is the low nibbles, 2c + 1 the high ones;
    # a Q4_1 block holds value v in byte v % 16 (the high nibble for v >= 16)
    for r in range(raw.shape[0]):
        for s in range(raw.shape[1] // 144):
            for c in range(4):
                src = s * 144 + 16 + 32 * c
                lo, hi = (s * 8 + 2 * c) * 20 + 4, (s * 8 + 2 * c + 1) * 20 + 4
                for j in range(16):
                    x0, x1 = raw[r, src + j], raw[r, src + 16 + j]
                    out[r, lo + j] = np.uint8((x0 & np.uint8(15)) | np.uint8((x1 & np.uint8(15)) << np.uint8(4)))
                    out[r, hi + j] = np.uint8((x0 >> np.uint8(4)) | (x1 & np.uint8(0xF0)))


# ---------------------------------------------------------------------------------------- 5/6-bit layouts
def decode_ints(qtype, raw: np.ndarray):
    """File blocks raw (rows, bytes_per_row) -> (q (rows, n) uint8 values, then per row and 32 values: q5: d,
    m f16 (rows, n / 32); q6: sc0, sc1 int8, d f16), or None (a Q5_0 / Q5_K scale beyond f16)."""
    rows = raw.shape[0]
    raw = np.ascontiguousarray(raw)
    if qtype == QT.Q6_K:
        blk = raw.reshape(rows, -1, 210)
        nsb = blk.shape[1]
        ql, qh = blk[..., 0:128].reshape(rows, nsb, 2, 64), blk[..., 128:192].reshape(rows, nsb, 2, 32)
        lo = np.stack([ql[..., :32] & 15, ql[..., 32:] & 15, ql[..., :32] >> 4, ql[..., 32:] >> 4], axis=-2)
        hi = np.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=-2)
        q = (lo | (hi << 4)).reshape(rows, nsb * 256)
        sc = blk[..., 192:208].copy().view(np.int8).reshape(rows, nsb * 8, 2)
        d = np.repeat(blk[..., 208:210].copy().view(np.float16)[..., 0], 8, axis=1)
        return q, sc[..., 0], sc[..., 1], d
    if qtype == QT.Q5_K:
        blk = raw.reshape(rows, -1, 176)
        nsb = blk.shape[1]
        qh, qs = blk[..., 16:48], blk[..., 48:176].reshape(rows, nsb, 4, 32)
        lo = np.stack([qs & 15, qs >> 4], axis=-2).reshape(rows, nsb, 8, 32)
        hi = np.stack([(qh >> j) & 1 for j in range(8)], axis=-2)
        dm = _k_rounded(blk)
        return None if dm is None else ((lo | (hi << 4)).reshape(rows, nsb * 256), *dm)
    if qtype in (QT.Q5_0, QT.Q5_1):
        bb, qh0 = (22, 2) if qtype == QT.Q5_0 else (24, 4)
        blk = raw.reshape(rows, -1, bb)
        nb = blk.shape[1]
        q = _q5_values(blk[..., qh0:qh0 + 4].reshape(-1, 4), blk[..., qh0 + 4:].reshape(-1, 16)).reshape(rows, nb * 32)
        d = blk[..., 0:2].copy().view(np.float16)[..., 0]
        if qtype == QT.Q5_1:
            return q, d, blk[..., 2:4].copy().view(np.float16)[..., 0]
        with np.errstate(over="ignore"):
            m = (d * np.float16(-16)).astype(np.float16)  # a power-of-two multiple: exact unless it overflows
        return None if np.any(np.isinf(m) & np.isfinite(d)) else (q, d, m)
    raise ValueError(f"not a 5/6-bit type: {QT(qtype).name}")


@njit(cache=True, nogil=True, inline="always")
def block_at(b, bits):
    """(index into a KWeight's blocks' second axis, byte offset there) of block b: q5 blocks one a row, q6
    block b % 8 of super-block b // 8 after its header."""
    if bits == 6:
        return b // 8, K6_HDR + (b % 8) * K6_BLK
    return b, 0


@njit(cache=True, nogil=True, inline="always")
def n_blocks(blk, bits):
    """Blocks of 32 values per row of a KWeight's blocks."""
    return blk.shape[1] * 8 if bits == 6 else blk.shape[1]


@njit(cache=True, nogil=True, inline="always")
def _byte(blk, g, b, i, bits):
    # byte i of block b of group g
    s, o = block_at(b, bits)
    return blk[g, s, o + i]


@njit(cache=True, nogil=True)
def _pack_header(blk, d):
    """q6: each super-block's header <- its rows' f16 d (d (rows, nsb * 2) uint8 bytes)."""
    for r in range(d.shape[0]):
        g, rr = r // G, r % G
        for s in range(blk.shape[1]):
            blk[g, s, 2 * rr] = d[r, 2 * s]
            blk[g, s, 2 * rr + 1] = d[r, 2 * s + 1]


@njit(cache=True, nogil=True)
def _pack_values(blk, q, bits):
    """Values q (rows, nb * 32) uint8 (< 2^bits) -> blk's nibbles and high-bit plane (kquant_avx2's
    docstring); padding rows stay zero."""
    rows, nb = q.shape[0], n_blocks(blk, bits)
    for r in range(rows):
        g, rr = r // G, r % G
        h, n, r8 = rr // 16, (rr % 16) // 8, rr % 8
        for b in range(nb):
            s, o = block_at(b, bits)
            for j in range(QK):
                k, e = j // 4, j % 4
                i = 4 * r8 + e
                v = q[r, b * QK + j]
                at = o + nib_at(2 * k + h, i)
                blk[g, s, at] = np.uint8(blk[g, s, at] | np.uint8((v & np.uint8(15)) << np.uint8(4 * n)))
                vv = 4 * k + 2 * h + n
                if bits == 5:
                    at, sh = o + P_OFF + 32 * (vv // 8) + i, vv % 8
                    hb = np.uint8((v >> np.uint8(4)) & np.uint8(1))
                else:
                    at, sh = o + P_OFF + 32 * k + i, 2 * (vv % 4)
                    hb = np.uint8((v >> np.uint8(4)) & np.uint8(3))
                blk[g, s, at] = np.uint8(blk[g, s, at] | np.uint8(hb << np.uint8(sh)))


@njit(cache=True, nogil=True)
def _pack_scales(blk, x, y, z, off, bits):
    """Per row and block the bytes of x, y (2-D arrays of one itemsize each, as uint8 views (rows, nb * k))
    at off, off + 32 k, ... of the block: byte off + k * rr .. = x[r, b * k ..] for the rows r = G g + rr; then
    y after x's 32 rows, z after y's (z / y may be empty)."""
    rows, nb = x.shape[0], n_blocks(blk, bits)
    for r in range(rows):
        g, rr = r // G, r % G
        at = off
        for arr in (x, y, z):
            k = arr.shape[1] // nb
            for b in range(nb):
                s, o = block_at(b, bits)
                for c in range(k):
                    blk[g, s, o + at + k * rr + c] = arr[r, b * k + c]
            at += k * G


def layout(qtype, rows: int, cols: int) -> list:
    """[(dtype, shape)] of a KWeight's arrays (its blocks) for a (rows, cols) matrix of qtype."""
    ng = (rows + G - 1) // G
    if BITS[qtype] == 6:
        return [(np.uint8, (ng, cols // QK // 8, SB6))]
    return [(np.uint8, (ng, cols // QK, BLK5Z if qtype == QT.Q5_0 else BLK5))]


def _u8(a) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view(np.uint8).reshape(a.shape[0], -1)


def repack(qt: QTensor):
    """qt's file blocks -> the blocks of its layout, CHUNK_ROWS rows at a time; None where a scale does not fit."""
    rows, cols = qt.shape[0], qt.shape[-1]
    raw = np.ascontiguousarray(qt.data).view(np.uint8).reshape(rows, -1)
    blk = np.zeros(layout(qt.qtype, rows, cols)[0][1], np.uint8)
    bits = BITS[qt.qtype]
    empty = np.zeros((rows, 0), np.uint8)
    for r0 in range(0, rows, CHUNK_ROWS):
        got = decode_ints(qt.qtype, raw[r0:r0 + CHUNK_ROWS])
        if got is None:
            return None
        part = blk[r0 // G:]
        _pack_values(part, np.ascontiguousarray(got[0]), bits)
        if bits == 5:  # d, m (f16 each; Q5_0: d alone, its m = -16 d checked to fit f16 above)
            m = got[2] if qt.qtype != QT.Q5_0 else empty[:got[0].shape[0]]
            _pack_scales(part, _u8(got[1]), _u8(m), empty[:got[0].shape[0]], Q5_D, bits)
        else:  # sc0, sc1 (int8); d (f16) once per super-block, in its header
            _pack_scales(part, _u8(got[1]), _u8(got[2]), empty[:got[0].shape[0]], Q6_SC0, bits)
            _pack_header(part, _u8(got[3][:, ::8]))
    return blk


def prepare_weight(qt: QTensor, store=None):
    """qt (2-D, a QTYPES type) on the fast path: a fast.FastWeight ('q4k') for Q4_K, a KWeight for the
    others; None where it cannot (a scale beyond f16: the caller keeps kernels.py's layout). store:
    weight_store.WeightStore or None (as fast.repack)."""
    from .fast_weights import _stored
    from .fast_weights import repack as repack_q4
    if qt.qtype == QT.Q4_K:  # fast's 'q4k' layout (q4k.py)
        return repack_q4(qt, store)
    rows, cols = qt.shape[0], qt.shape[-1]
    got = _stored(store, qt.name, layout(qt.qtype, rows, cols))
    if got is None:
        blk = repack(qt)
        if blk is None:
            return None
        got = (blk,)
        if store is not None:
            store.put(qt.name, got)
    return KWeight(qt.name, qt.qtype, (rows, cols), got[0])


def with_m(blk: np.ndarray) -> np.ndarray:
    """q5 blocks (..., BLK5Z or BLK5) -> BLK5 blocks: a Q5_0 block's m = f16(-16 d) (exact: repack checked it fits)
    written after its d, so it can share a stack with Q5_1 / Q5_K blocks."""
    if blk.shape[-1] == BLK5:
        return blk
    out = np.zeros(blk.shape[:-1] + (BLK5,), np.uint8)
    out[..., :BLK5Z] = blk
    d = np.ascontiguousarray(blk[..., Q5_D:Q5_M]).view(np.float16)
    out[..., Q5_M:] = (d * np.float16(-16)).astype(np.float16).view(np.uint8)
    return out


# ---------------------------------------------------------------------------------------- generic kernels
@njit(cache=True, nogil=True, inline="always")
def _h(blk, g, b, i, bits):
    # the f16 bits at bytes i, i + 1 of block b of group g, as f32
    return h2f(np.uint16(np.uint16(_byte(blk, g, b, i, bits)) | np.uint16(np.uint16(_byte(blk, g, b, i + 1, bits))
                                                                          << np.uint16(8))))


@njit(cache=True, nogil=True, inline="always")
def _m(blk, g, b, r, dv):
    # q5: the m of row r in block b of group g, as f32 (-16 d where the blocks have none: Q5_0's, BLK5Z)
    return _h(blk, g, b, Q5_M + 2 * r, 5) if blk.shape[2] == BLK5 else F32(-16.0) * dv


@njit(cache=True, nogil=True, inline="always")
def _d6(blk, g, b, r):
    # q6: the f16 d of row r in block b's super-block header, as f32
    s = b // 8
    return h2f(np.uint16(np.uint16(blk[g, s, 2 * r]) | np.uint16(np.uint16(blk[g, s, 2 * r + 1]) << np.uint16(8))))


@njit(cache=True, nogil=True, inline="always")
def value(blk, g, b, rr, j, bits):
    """Value j (< 32) of row rr (< G) of block b of group g: its nibble and its high bits from the plane."""
    h, n, r8 = rr // 16, (rr % 16) // 8, rr % 8
    k, e = j // 4, j % 4
    i = 4 * r8 + e
    v = (I32(_byte(blk, g, b, nib_at(2 * k + h, i), bits)) >> (4 * n)) & 15
    vv = 4 * k + 2 * h + n
    if bits == 5:
        return v | (((I32(_byte(blk, g, b, P_OFF + 32 * (vv // 8) + i, bits)) >> (vv % 8)) & 1) << 4)
    return v | (((I32(_byte(blk, g, b, P_OFF + 32 * k + i, bits)) >> (2 * (vv % 4))) & 3) << 4)


@njit(cache=True, nogil=True)
def rows_generic(o, qa, sa, xs, blk, g, t, bits):
    """o (G,) <- the G outputs of group g for activation row t: kquant_avx2's block terms, summed over the
    blocks in order (the kernels of hosts without AVX2, and the tests' reference)."""
    s = np.zeros((2, G), np.int32)
    for r in range(G):
        o[r] = F32(0.0)
    for b in range(n_blocks(blk, bits)):
        s[:] = 0
        a0, a1 = 0, 0
        for j in range(QK):
            x = I32(qa[t, b * QK + j])
            if j < 16:
                a0 += x
            else:
                a1 += x
            for r in range(G):
                s[j // 16, r] += value(blk, g, b, r, j, bits) * x
        sb = sa[t, b]
        for r in range(G):
            if bits == 5:
                dv = _h(blk, g, b, Q5_D + 2 * r, bits)
                m16 = _m(blk, g, b, r, dv) + F32(16.0) * dv  # Q5_0's: -16 d + 16 d, 0 exactly
                o[r] += (dv * sb) * F32(s[0, r] + s[1, r] - 16 * (a0 + a1)) + m16 * xs[t, XS * b]
            else:
                sc0 = I32(np.int8(_byte(blk, g, b, Q6_SC0 + r, bits)))
                sc1 = I32(np.int8(_byte(blk, g, b, Q6_SC1 + r, bits)))
                isum = sc0 * (s[0, r] - 32 * a0) + sc1 * (s[1, r] - 32 * a1)
                o[r] += (_d6(blk, g, b, r) * sb) * F32(isum)


# ------------------------------------------------------------------------------------------- AVX2 kernels
@njit(cache=True, nogil=True, inline="always")
def _grp(o, o0, qa, sa, xs, blk, g, t, bits):
    # o[o0 : o0 + G] (flat) <- all blocks of group g for activation row t (kquant_avx2.grp5 / grp6)
    bo, ao, so, xo = g * blk.strides[0], t * qa.strides[0], t * (sa.strides[0] // 4), t * (xs.strides[0] // 4)
    if bits == 5:
        kx.grp5(o, o0, blk, bo, qa, ao, sa, xs, so, xo, blk.shape[1])
    else:
        kx.grp6(o, o0, blk, bo, qa, ao, sa, xs, so, xo, n_blocks(blk, 6))


@njit(cache=True, nogil=True, inline="always")
def _grp_rows(o, o0, o_st, qa, sa, xs, blk, g, t, n, bits):
    # activation rows t .. t + n - 1 (n <= kx.ROWS_MAX) into o at flat offsets o0 + i o_st <- all blocks of
    # group g (kquant_avx2.grp*_rows*, each value vector merged once for the n rows)
    a0, ast = t * qa.strides[0], qa.strides[0]
    s0, sst = t * (sa.strides[0] // 4), sa.strides[0] // 4
    x0, xst = t * (xs.strides[0] // 4), xs.strides[0] // 4
    bo, nb = g * blk.strides[0], n_blocks(blk, bits)
    if n == 1:
        if bits == 5:
            kx.grp5(o, o0, blk, bo, qa, a0, sa, xs, s0, x0, nb)
        else:
            kx.grp6(o, o0, blk, bo, qa, a0, sa, xs, s0, x0, nb)
    elif bits == 5:
        if n == 4:
            kx.grp5_rows4(o, o0, o_st, blk, bo, qa, a0, ast, sa, xs, s0, sst, x0, xst, nb)
        elif n == 3:
            kx.grp5_rows3(o, o0, o_st, blk, bo, qa, a0, ast, sa, xs, s0, sst, x0, xst, nb)
        else:
            kx.grp5_rows2(o, o0, o_st, blk, bo, qa, a0, ast, sa, xs, s0, sst, x0, xst, nb)
    elif n == 4:
        kx.grp6_rows4(o, o0, o_st, blk, bo, qa, a0, ast, sa, xs, s0, sst, x0, xst, nb)
    elif n == 3:
        kx.grp6_rows3(o, o0, o_st, blk, bo, qa, a0, ast, sa, xs, s0, sst, x0, xst, nb)
    else:
        kx.grp6_rows2(o, o0, o_st, blk, bo, qa, a0, ast, sa, xs, s0, sst, x0, xst, nb)


# Up to this many activation rows run the multi-row decode form (no merged copy per block): 16, or any T where
# the target has AVX512-VNNI (kx.VNNI512: 512-bit vpdpbusd; 3072x1024, one thread, an AVX-512 Xeon, T = 64:
# see bench/results-kquant.md)
ROWS_MERGED = (1 << 30) if kx.VNNI512 else 16


@njit(cache=True, nogil=True)
def group(out, qa, sa, xs, blk, g, bits):
    """Rows g*G .. g*G+G-1 of out (T, rows) <- x @ W^T. AVX2: a decode row (T = 1) runs all the group's
    blocks with its outputs in registers; up to ROWS_MERGED rows run the same form for kx.ROWS_MAX rows at
    a time (each value vector merged once in registers for them); more rows (a prompt chunk) merge each
    block's bits once into an L1 buffer (unpack) for all T rows. The same block terms summed in the same
    order, so each row equals a one-row call bit for bit."""
    t_n = out.shape[0]
    n = min(G, out.shape[1] - g * G)
    if not HAVE_AVX2:
        tmp = np.empty(G, np.float32)
        for t in range(t_n):
            rows_generic(tmp, qa, sa, xs, blk, g, t, bits)
            for r in range(n):
                out[t, g * G + r] = tmp[r]
        return
    if t_n == 1 and n == G:
        _grp(out, g * G, qa, sa, xs, blk, g, 0, bits)
        return
    part = np.zeros((t_n, G), np.float32)  # (T, G): the rows' sums (a padded group's too)
    if t_n <= ROWS_MERGED:
        for t in range(0, t_n, kx.ROWS_MAX):
            _grp_rows(part, t * G, G, qa, sa, xs, blk, g, t, min(kx.ROWS_MAX, t_n - t), bits)
        for t in range(t_n):
            for r in range(n):
                out[t, g * G + r] = part[t, r]
        return
    buf = np.empty(kx.UNBUF, np.uint8)
    for b in range(n_blocks(blk, bits)):
        if bits == 5:
            kx.unpack5(buf, blk, g * blk.strides[0], b)
        else:
            kx.unpack6(buf, blk, g * blk.strides[0], b)
        for t in range(t_n):
            if bits == 5:
                kx.blku5(part, t * G, buf, qa, t * qa.strides[0] + b * QK, sa[t, b], xs[t, XS * b],
                         xs[t, XS * b + XS_A], xs[t, XS * b + XS_A0])
            else:
                kx.blku6(part, t * G, buf, qa, t * qa.strides[0] + b * QK, sa[t, b], xs[t, XS * b],
                         xs[t, XS * b + XS_A], xs[t, XS * b + XS_A0])
    for t in range(t_n):
        for r in range(n):
            out[t, g * G + r] = part[t, r]


@njit(cache=True, nogil=True, parallel=True)
def mm(out, qa, sa, xs, blk, bits):
    """out (T, rows) f32 <- x @ W^T for a q5 / q6 W (KWeight's blocks); x as qa (T, n) int8, sa (T, nb),
    xs (T, XS nb) (fast.quantize_rows). One parallel region over the row groups."""
    for g in prange(blk.shape[0]):
        group(out, qa, sa, xs, blk, np.int64(g), bits)


@njit(cache=True, nogil=True)
def mm_part(lo, hi, out, qa, sa, xs, blk, bits):
    """Row groups lo..hi of mm on the calling thread (the cold start's kernel-by-kernel step: tier.py)."""
    for g in range(lo, hi):
        group(out, qa, sa, xs, blk, g, bits)


def matmul(out, qa, sa, xs, w: KWeight) -> None:
    """out (T, rows) <- x @ W^T, x quantized by fast.quantize_rows (qa, sa, xs)."""
    mm(out, qa, sa, xs, w.blocks, w.bits)


@njit(cache=True, nogil=True)
def embed_rows(out, blk, tokens, bits):
    """out (T, n) <- rows tokens (T,) of a q5 / q6 table: d q + m (q5), (d sc) (q - 32) (q6): the reference's
    values (Q5_0, Q5_1, Q6_K exactly; Q5_K with its f16 scales)."""
    for t in range(tokens.shape[0]):
        g, rr = tokens[t] // G, tokens[t] % G
        for b in range(n_blocks(blk, bits)):
            for j in range(QK):
                q = value(blk, g, b, rr, j, bits)
                if bits == 5:
                    dv = _h(blk, g, b, Q5_D + 2 * rr, bits)
                    v = dv * F32(q) + _m(blk, g, b, rr, dv)
                else:
                    sc = I32(np.int8(_byte(blk, g, b, (Q6_SC0 if j < 16 else Q6_SC1) + rr, bits)))
                    v = (_d6(blk, g, b, rr) * F32(sc)) * F32(q - 32)
                out[t, b * QK + j] = v


def embed(out, w: KWeight, tokens) -> None:
    embed_rows(out, w.blocks, tokens, w.bits)
