"""CPU kernels (numba @njit): same names, signatures and meaning as `ref.py`.

Each public kernel is a thin Python function that picks a jitted implementation (`_name` below) from the
prepared weight's kind or the array dtypes; all loops run in numba. First version: correct and reasonably
fast, structured so the speed issue can swap implementations behind the same names.

Weight layout (`prepare_weight`): quants and scales are split apart at load time.
- Q8_0: qs int8 (d, nb, 32), scale f32 (d, nb)                      x = d * q
- Q4_0: qs uint8 (d, nb, 16) (raw nibble bytes), scale f32 (d, nb)  x = d * (q - 8)
- Q4_1: qs uint8 (d, nb, 16), scale f32 (d, nb), min f32 (d, nb)    x = d * q + m
- Q4_K: qs uint8 (d, nb, 128), sc f32 (d, nb, 8) = d * scale_j, mn f32 (d, nb, 8) = dmin * min_j
- Q6_K: ql uint8 (d, nb, 128), qh uint8 (d, nb, 64), sc f32 (d, nb, 16) = d * scales_j
- F32, F16, BF16: dense f32 (d, n) (F16/BF16 then take twice their file size).
The quantized matmuls dequantize one weight row at a time into a per-thread f32 buffer and dot it with
all T activation rows (float activations; int8 activations are the speed issue's business).

float16 KV caches are passed to numba as their uint16 bit patterns (numba has no CPU float16).
"""
from __future__ import annotations

from ... import numba_env  # noqa: F401  (before numba: SLP vectorizer on, workqueue threads, flag-keyed cache)

import numpy as np
from ...gguf_types import GGMLQuantizationType as QT
from numba import njit, prange

from ...quant import QTensor, _q4k_scales, block_info, dequantize, validate
from .attn import h2f as _h2f  # half bits -> float32: F16C where the CPU has it
from .attn_int8_avx2 import quantize_rows_q8
from ..ref.kernels import KV_GROUP, kv_group  # noqa: F401  (re-exported: same constants in every kernel module)



class CpuWeight:
    """A weight in the CPU layout (see module docstring).

    kind: 'q8_0' | 'q4_0' | 'q4_1' | 'q4_k' | 'q6_k' | 'dense'; arrays: the kind's arrays in the order its
    row-dequant helper (`_row_<kind>`) takes them.
    """

    def __init__(self, name, kind, shape, arrays):
        self.name, self.kind, self.shape = name, kind, shape
        self.arrays = arrays


class CpuScratch:
    """matmul scratch (unused by this version's kernels; kept so faster kernels can keep quantized
    activations here without changing the signature)."""

    def __init__(self, max_t: int, max_n: int):
        self.max_t, self.max_n = max_t, max_n


def _f16_field(raw, lo):
    # (d, nb, B) uint8 -> (d, nb) f32 from the little-endian half at bytes lo..lo+1 of each block
    return np.ascontiguousarray(raw[:, :, lo:lo + 2]).view(np.float16)[..., 0].astype(np.float32)


def prepare_weight(qt: QTensor) -> CpuWeight:
    """Repack a file tensor into the CPU layout (called once at load time)."""
    validate(qt)
    rows, cols = qt.shape[0], qt.shape[-1]
    shape = (rows, cols) if len(qt.shape) > 1 else (1, cols)
    if qt.qtype in (QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q4_K, QT.Q6_K):
        bs, _ = block_info(qt.qtype, qt.name)
        raw = np.ascontiguousarray(qt.data).view(np.uint8).reshape(shape[0], cols // bs, -1)  # (d, nb, B)
        part = (lambda lo, hi: np.ascontiguousarray(raw[:, :, lo:hi]))  # noqa: E731
    if qt.qtype == QT.Q8_0:
        return CpuWeight(qt.name, "q8_0", shape, (part(2, 34).view(np.int8), _f16_field(raw, 0)))
    if qt.qtype == QT.Q4_0:
        return CpuWeight(qt.name, "q4_0", shape, (part(2, 18), _f16_field(raw, 0)))
    if qt.qtype == QT.Q4_1:
        return CpuWeight(qt.name, "q4_1", shape, (part(4, 20), _f16_field(raw, 0), _f16_field(raw, 2)))
    if qt.qtype == QT.Q4_K:  # fold d and dmin into the 8 sub-block scales / mins once
        sc, mn = _q4k_scales(raw[:, :, 4:16].reshape(-1, 12))  # (d*nb, 8) each
        sc = (sc.reshape(shape[0], -1, 8) * _f16_field(raw, 0)[..., None]).astype(np.float32)
        mn = (mn.reshape(shape[0], -1, 8) * _f16_field(raw, 2)[..., None]).astype(np.float32)
        return CpuWeight(qt.name, "q4_k", shape, (part(16, 144), sc, mn))
    if qt.qtype == QT.Q6_K:
        sc = (part(192, 208).view(np.int8).astype(np.float32) * _f16_field(raw, 208)[..., None]).astype(np.float32)
        return CpuWeight(qt.name, "q6_k", shape, (part(0, 128), part(128, 192), sc))
    # F32 / F16 / BF16: dense f32 (F16/BF16 take 2x their file size; fine for the small tensors they hold)
    return CpuWeight(qt.name, "dense", shape, (np.ascontiguousarray(dequantize(qt).reshape(shape), np.float32),))


def weight_shape(w: CpuWeight) -> tuple[int, int]:
    """Logical (rows, cols) = (out_features, in_features) of a prepared weight."""
    return w.shape


def new_scratch(max_t: int, max_n: int) -> CpuScratch:
    """Scratch for `matmul` covering x of up to (max_t, max_n)."""
    return CpuScratch(max_t, max_n)


# ----------------------------------------------------------------------------------------------- linear
# One helper per layout dequantizes weight row r into buf (n,) f32; the matmul and embedding kernels share
# them. A matmul thread takes a chunk of _ROWS rows, dequantizes one row at a time into its own buffer
# (vectorizable), then takes the T dot products with it (vectorizable): each block is read once for all T.
_ROWS = 16


@njit(cache=True, nogil=True, inline="always")
def _row_q8_0(buf, r, qs, scale):
    for b in range(qs.shape[1]):
        d = scale[r, b]
        for j in range(32):
            buf[b * 32 + j] = np.float32(qs[r, b, j]) * d


@njit(cache=True, nogil=True, inline="always")
def _row_q4(buf, r, qs, scale, mins, offset):
    # value = scale * q + mins (Q4_1, offset=0) or scale * (q - 8) (Q4_0, offset=8; mins unused).
    # Nibbles: lo = values 0..15, hi = 16..31 of a block.
    for b in range(qs.shape[1]):
        d = scale[r, b]
        m = mins[r, b] if offset == 0 else np.float32(-offset) * d
        for j in range(16):
            q = qs[r, b, j]
            buf[b * 32 + j] = np.float32(q & 15) * d + m
            buf[b * 32 + 16 + j] = np.float32(q >> 4) * d + m


@njit(cache=True, nogil=True, inline="always")
def _row_q4_k(buf, r, qs, sc, mn):
    # qs (d, nb, 128): 64-value chunk c = sub-blocks 2c (lo nibbles of bytes 32c..32c+31) and 2c+1 (hi)
    for b in range(qs.shape[1]):
        for c in range(4):
            s0, m0, s1, m1 = sc[r, b, 2 * c], mn[r, b, 2 * c], sc[r, b, 2 * c + 1], mn[r, b, 2 * c + 1]
            base = b * 256 + c * 64
            for j in range(32):
                q = qs[r, b, c * 32 + j]
                buf[base + j] = np.float32(q & 15) * s0 - m0
                buf[base + 32 + j] = np.float32(q >> 4) * s1 - m1


@njit(cache=True, nogil=True, inline="always")
def _row_q6_k(buf, r, ql, qh, sc):
    # per 128-value half h, l in 0..31: values l, l+32, l+64, l+96 take 4 low bits from ql[l], ql[l+32],
    # ql[l] >> 4, ql[l+32] >> 4 and 2 high bits from qh[l] bits 0-1, 2-3, 4-5, 6-7; scale j per 16 values
    for b in range(ql.shape[1]):
        for h in range(2):
            base = b * 256 + h * 128
            for j in range(32):
                a, c, hb = ql[r, b, h * 64 + j], ql[r, b, h * 64 + 32 + j], qh[r, b, h * 32 + j]
                k = h * 8 + j // 16
                buf[base + j] = sc[r, b, k] * np.float32(np.int32((a & 15) | ((hb & 3) << 4)) - 32)
                buf[base + 32 + j] = sc[r, b, k + 2] * np.float32(np.int32((c & 15) | (((hb >> 2) & 3) << 4)) - 32)
                buf[base + 64 + j] = sc[r, b, k + 4] * np.float32(np.int32((a >> 4) | (((hb >> 4) & 3) << 4)) - 32)
                buf[base + 96 + j] = sc[r, b, k + 6] * np.float32(np.int32((c >> 4) | ((hb >> 6) << 4)) - 32)


@njit(cache=True, nogil=True, inline="always")
def _dots(out, x, buf, r):
    # out[t, r] <- buf (n,) . x[t] for every row t. Every row takes the same loop (the same vectorized
    # summation order), so a row of a T-token pass is bitwise equal to a one-token step: speculative
    # verification and chunked prefill then agree exactly with plain decode. buf stays in L1 across rows.
    for t in range(x.shape[0]):
        s = np.float32(0.0)
        for i in range(x.shape[1]):
            s += buf[i] * x[t, i]
        out[t, r] = s


@njit(cache=True, nogil=True, parallel=True, fastmath=True)
def _mm_q8_0(out, x, qs, scale):
    # out (T, d) <- x (T, n) @ W^T; W = scale (d, nb) * qs (d, nb, 32) int8
    d_rows = qs.shape[0]
    for c in prange((d_rows + _ROWS - 1) // _ROWS):
        buf = np.empty(x.shape[1], np.float32)  # one dequantized row
        for r in range(c * _ROWS, min(d_rows, (c + 1) * _ROWS)):
            _row_q8_0(buf, r, qs, scale)
            _dots(out, x, buf, r)


@njit(cache=True, nogil=True, parallel=True, fastmath=True)
def _mm_q4(out, x, qs, scale, mins, offset):
    d_rows = qs.shape[0]
    for c in prange((d_rows + _ROWS - 1) // _ROWS):
        buf = np.empty(x.shape[1], np.float32)
        for r in range(c * _ROWS, min(d_rows, (c + 1) * _ROWS)):
            _row_q4(buf, r, qs, scale, mins, offset)
            _dots(out, x, buf, r)


@njit(cache=True, nogil=True, parallel=True, fastmath=True)
def _mm_q4_k(out, x, qs, sc, mn):
    d_rows = qs.shape[0]
    for c in prange((d_rows + _ROWS - 1) // _ROWS):
        buf = np.empty(x.shape[1], np.float32)
        for r in range(c * _ROWS, min(d_rows, (c + 1) * _ROWS)):
            _row_q4_k(buf, r, qs, sc, mn)
            _dots(out, x, buf, r)


@njit(cache=True, nogil=True, parallel=True, fastmath=True)
def _mm_q6_k(out, x, ql, qh, sc):
    d_rows = ql.shape[0]
    for c in prange((d_rows + _ROWS - 1) // _ROWS):
        buf = np.empty(x.shape[1], np.float32)
        for r in range(c * _ROWS, min(d_rows, (c + 1) * _ROWS)):
            _row_q6_k(buf, r, ql, qh, sc)
            _dots(out, x, buf, r)


@njit(cache=True, nogil=True, parallel=True, fastmath=True)
def _mm_dense(out, x, w):
    # out (T, d) <- x (T, n) @ w (d, n)^T
    for r in prange(w.shape[0]):
        _dots(out, x, w[r], r)


def matmul(out, x, w, scratch):
    """out (T, d) f32 <- x (T, n) f32 @ W (d, n)^T. One pass over W serves all T rows."""
    k = w.kind
    if k == "q4_1":
        _mm_q4(out, x, *w.arrays, 0)
    elif k == "q8_0":
        _mm_q8_0(out, x, *w.arrays)
    elif k == "q4_0":
        _mm_q4(out, x, *w.arrays, w.arrays[1], 8)
    elif k == "q4_k":
        _mm_q4_k(out, x, *w.arrays)
    elif k == "q6_k":
        _mm_q6_k(out, x, *w.arrays)
    else:
        _mm_dense(out, x, *w.arrays)


# Embedding lookups: the same row helpers, writing straight into the output rows.
@njit(cache=True, nogil=True)
def _embed_q8_0(out, tokens, qs, scale):
    for t in range(tokens.shape[0]):
        _row_q8_0(out[t], tokens[t], qs, scale)


@njit(cache=True, nogil=True)
def _embed_q4(out, tokens, qs, scale, mins, offset):
    for t in range(tokens.shape[0]):
        _row_q4(out[t], tokens[t], qs, scale, mins, offset)


@njit(cache=True, nogil=True)
def _embed_q4_k(out, tokens, qs, sc, mn):
    for t in range(tokens.shape[0]):
        _row_q4_k(out[t], tokens[t], qs, sc, mn)


@njit(cache=True, nogil=True)
def _embed_q6_k(out, tokens, ql, qh, sc):
    for t in range(tokens.shape[0]):
        _row_q6_k(out[t], tokens[t], ql, qh, sc)


def embed(out, w, tokens):
    """out (T, n) f32 <- rows tokens (T,) int32 of the embedding table W (vocab, n)."""
    k = w.kind
    if k == "q8_0":
        _embed_q8_0(out, tokens, *w.arrays)
    elif k == "q4_1":
        _embed_q4(out, tokens, *w.arrays, 0)
    elif k == "q4_0":
        _embed_q4(out, tokens, *w.arrays, w.arrays[1], 8)
    elif k == "q4_k":
        _embed_q4_k(out, tokens, *w.arrays)
    elif k == "q6_k":
        _embed_q6_k(out, tokens, *w.arrays)
    else:
        out[:] = w.arrays[0][tokens]


@njit(cache=True, nogil=True)
def bias_add(out, b):
    """out (T, n) += b (n,) f32."""
    for t in range(out.shape[0]):
        for i in range(out.shape[1]):
            out[t, i] += b[i]


@njit(cache=True, nogil=True)
def residual_add(out, x):
    """out (T, n) += x (T, n)."""
    for t in range(out.shape[0]):
        for i in range(out.shape[1]):
            out[t, i] += x[t, i]


# ------------------------------------------------------------------------------------------ elementwise
@njit(cache=True, nogil=True)
def rmsnorm(out, x, w, eps):
    """out (R, n) <- x (R, n) / sqrt(mean(x^2) + eps) * w (n,). The sum of squares in float64 (exact enough
    to match ref for any n) over eight interleaved partial sums: one running sum was a chain of dependent
    adds, 0.64 us for n = 576 (0.21 us so; the squares are exact in float64 and the order moves only the
    last bits of the float64 sum)."""
    n = x.shape[1]
    n8 = n - n % 8
    for r in range(x.shape[0]):
        s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = 0.0
        for i in range(0, n8, 8):
            s0 += np.float64(x[r, i]) * x[r, i]
            s1 += np.float64(x[r, i + 1]) * x[r, i + 1]
            s2 += np.float64(x[r, i + 2]) * x[r, i + 2]
            s3 += np.float64(x[r, i + 3]) * x[r, i + 3]
            s4 += np.float64(x[r, i + 4]) * x[r, i + 4]
            s5 += np.float64(x[r, i + 5]) * x[r, i + 5]
            s6 += np.float64(x[r, i + 6]) * x[r, i + 6]
            s7 += np.float64(x[r, i + 7]) * x[r, i + 7]
        ss = ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))
        for i in range(n8, n):
            ss += np.float64(x[r, i]) * x[r, i]
        inv = np.float32(1.0 / np.sqrt(ss / n + eps))
        for i in range(n):
            out[r, i] = x[r, i] * inv * w[i]


@njit(cache=True, nogil=True, fastmath=True)
def swiglu(out, gate, up):
    """out (T, f) <- silu(gate (T, f)) * up (T, f)."""
    for t in range(out.shape[0]):
        for i in range(out.shape[1]):
            g = gate[t, i]
            out[t, i] = g / (np.float32(1.0) + np.exp(-g)) * up[t, i]


@njit(cache=True, nogil=True, inline="always")
def _rotate(x, t, i, c, s, neox):
    # pair i of every head of row t by the angle whose cosine and sine are c, s (f64)
    half = x.shape[2] // 2
    ia, ib = (i, i + half) if neox else (2 * i, 2 * i + 1)
    for h in range(x.shape[1]):
        a, b = np.float64(x[t, h, ia]), np.float64(x[t, h, ib])
        x[t, h, ia] = a * c - b * s
        x[t, h, ib] = a * s + b * c


@njit(cache=True, nogil=True)
def rope(x, pos0, inv_freq, neox):
    """Rotate x (T, H, hd) in place, row t at position pos0 + t (pairs: halves if neox, else adjacent)."""
    for t in range(x.shape[0]):
        for i in range(x.shape[2] // 2):
            ang = np.float64(pos0 + t) * np.float64(inv_freq[i])
            _rotate(x, t, i, np.cos(ang), np.sin(ang), neox)


@njit(cache=True, nogil=True)
def rope_table(cs, pos0, inv_freq):
    """cs (T, hd / 2, 2) f64 <- cos, sin of every angle rope uses for rows at positions pos0.. : computed once
    per forward pass and shared by q and k of every layer (rope_apply), instead of 2 x layers times."""
    for t in range(cs.shape[0]):
        for i in range(cs.shape[1]):
            ang = np.float64(pos0 + t) * np.float64(inv_freq[i])
            cs[t, i, 0] = np.cos(ang)
            cs[t, i, 1] = np.sin(ang)


@njit(cache=True, nogil=True)
def rope_apply(x, cs, neox):
    """rope(x, pos0, inv_freq, neox) with the angles' cos, sin from rope_table (same bits)."""
    for t in range(x.shape[0]):
        for i in range(x.shape[2] // 2):
            _rotate(x, t, i, cs[t, i, 0], cs[t, i, 1], neox)


@njit(cache=True, nogil=True, inline="always")
def max_lanes8(m0, m1, m2, m3, m4, m5, m6, m7, a0, a1, a2, a3, a4, a5, a6, a7):
    """Eight running maxima, each lane's a_j taken where it is larger (a NaN never is): written out so that
    SLP packs the lanes into one vector compare-and-select (argmax_row; sampling_fast._lanes_max)."""
    return (a0 if a0 > m0 else m0, a1 if a1 > m1 else m1, a2 if a2 > m2 else m2, a3 if a3 > m3 else m3,
            a4 if a4 > m4 else m4, a5 if a5 > m5 else m5, a6 if a6 > m6 else m6, a7 if a7 > m7 else m7)


@njit(cache=True, nogil=True)
def argmax_row(x):
    """The first index of the largest value of x (n,) f32, as np.argmax (a NaN counts as the largest).
    Two passes: the maximum over eight interleaved lanes of compare-and-select (numba's max() kept one
    running maximum scalar: 41 us for 49152 values), then its first index, found by counting equal values
    64 at a time (an early-exit loop stays scalar). ~15 us for 49152 values, called from Python (np.argmax:
    5 us; the lanes alone 2.6 us: the z lanes, x * 0, which is NaN for a NaN or an infinity, cost the rest).
    A row with a NaN or an infinity takes a scalar pass instead."""
    n = x.shape[0]
    n8 = n - n % 8
    zero = np.float32(0.0)
    m0 = m1 = m2 = m3 = m4 = m5 = m6 = m7 = np.float32(-np.inf)
    z0 = z1 = z2 = z3 = z4 = z5 = z6 = z7 = zero
    for i in range(0, n8, 8):
        a0 = x[i]
        a1 = x[i + 1]
        a2 = x[i + 2]
        a3 = x[i + 3]
        a4 = x[i + 4]
        a5 = x[i + 5]
        a6 = x[i + 6]
        a7 = x[i + 7]
        z0 += a0 * zero
        z1 += a1 * zero
        z2 += a2 * zero
        z3 += a3 * zero
        z4 += a4 * zero
        z5 += a5 * zero
        z6 += a6 * zero
        z7 += a7 * zero
        m0, m1, m2, m3, m4, m5, m6, m7 = max_lanes8(m0, m1, m2, m3, m4, m5, m6, m7, a0, a1, a2, a3, a4, a5, a6, a7)
    m = max(max(max(m0, m1), max(m2, m3)), max(max(m4, m5), max(m6, m7)))
    z = ((z0 + z1) + (z2 + z3)) + ((z4 + z5) + (z6 + z7))
    for i in range(n8, n):
        z += x[i] * zero
        m = max(m, x[i])
    if z == zero:
        for base in range(0, n, 64):
            end = min(base + 64, n)
            c = 0
            for i in range(base, end):
                c += x[i] == m
            if c:
                for i in range(base, end):
                    if x[i] == m:
                        return i
    best, bi = x[0], 0
    for i in range(n):
        if x[i] != x[i]:
            return i
        if x[i] > best:
            best, bi = x[i], i
    return bi


@njit(cache=True, nogil=True)
def argmax(out, logits):
    """out (T,) int32 <- index of the largest value of each row of logits (T, vocab) (first on ties)."""
    for t in range(logits.shape[0]):
        out[t] = argmax_row(logits[t])


# ---------------------------------------------------------------------------------------------- KV cache
def kv_store_f16(k_cache, v_cache, k, v, pos0):
    """k_cache, v_cache (cap, n_kv, hd) f16 [pos0 : pos0+T] <- k, v (T, n_kv, hd) f32."""
    t_n = k.shape[0]
    k_cache[pos0:pos0 + t_n] = k  # numpy's cast rounds to nearest even, like ref
    v_cache[pos0:pos0 + t_n] = v


@njit(cache=True, nogil=True)
def _quant_rows(q, s, x, pos0):
    # q (cap, n_kv, hd) int8, s (cap, n_kv, hd//g) f32 [pos0+t] <- x (T, n_kv, hd); see ref.quantize_kv_int8.
    # In 16-lane vectors (attn_int8_avx2.quantize_rows_q8, the same bits) where the groups allow it: the
    # loop below cost a decode step's serial tails ~7 us per token more.
    group = x.shape[2] // s.shape[2]
    if group % 16 == 0 and x.strides[2] == 4 and q.strides[2] == 1:
        quantize_rows_q8(q, s, x, np.int64(pos0))
        return
    for t in range(x.shape[0]):
        for h in range(x.shape[1]):
            for gi in range(s.shape[2]):
                amax = np.float32(0.0)
                for j in range(group):
                    amax = max(amax, abs(x[t, h, gi * group + j]))
                sc = amax / np.float32(127.0)
                inv = np.float32(1.0) / sc if sc > 0 else np.float32(0.0)
                s[pos0 + t, h, gi] = sc
                for j in range(group):
                    y = x[t, h, gi * group + j] * inv
                    r = np.trunc(y + (np.float32(0.5) if y >= 0 else np.float32(-0.5)))
                    q[pos0 + t, h, gi * group + j] = np.int8(min(max(r, -127.0), 127.0))


def kv_store_int8(k_q, k_s, v_q, v_s, k, v, pos0):
    """k_q, v_q (cap, n_kv, hd) int8 and k_s, v_s (cap, n_kv, hd//g) f32 [pos0 : pos0+T] <- k, v (T, n_kv, hd)."""
    _quant_rows(k_q, k_s, k, pos0)
    _quant_rows(v_q, v_s, v, pos0)


@njit(cache=True, nogil=True, parallel=True, fastmath=True)
def _attn_f16(out, q, k_c, v_c, pos0, scale):
    # out (T, H, hd) <- causal GQA attention of q (T, H, hd) over cache positions 0..pos0+t;
    # k_c, v_c (cap, n_kv, hd) uint16 = f16 bits. Two passes per (t, h): scores, then softmax-weighted V.
    t_n, n_head, hd = q.shape
    group = n_head // k_c.shape[1]
    for th in prange(t_n * n_head):
        t, h = th // n_head, th % n_head
        kh = h // group
        n_see = pos0 + t + 1
        sc = np.empty(n_see, np.float32)
        qv = q[t, h]
        for p in range(n_see):
            s = np.float32(0.0)
            for j in range(hd):
                s += qv[j] * _h2f(k_c[p, kh, j])
            sc[p] = s * scale
        _softmax_inplace(sc)
        acc = out[t, h]
        acc[:] = 0.0
        for p in range(n_see):
            w = sc[p]
            for j in range(hd):
                acc[j] += w * _h2f(v_c[p, kh, j])


@njit(cache=True, nogil=True, parallel=True, fastmath=True)
def _attn_int8(out, q, k_q, k_s, v_q, v_s, pos0, scale):
    # As _attn_f16 over int8 quants (cap, n_kv, hd) with f32 scales (cap, n_kv, hd // g) per g values.
    t_n, n_head, hd = q.shape
    group = n_head // k_q.shape[1]
    n_g = k_s.shape[2]
    g = hd // n_g
    for th in prange(t_n * n_head):
        t, h = th // n_head, th % n_head
        kh = h // group
        n_see = pos0 + t + 1
        sc = np.empty(n_see, np.float32)
        qv = q[t, h]
        for p in range(n_see):
            s = np.float32(0.0)
            for gi in range(n_g):
                part = np.float32(0.0)
                for j in range(g):
                    part += qv[gi * g + j] * np.float32(k_q[p, kh, gi * g + j])
                s += part * k_s[p, kh, gi]
            sc[p] = s * scale
        _softmax_inplace(sc)
        acc = out[t, h]
        acc[:] = 0.0
        for p in range(n_see):
            for gi in range(n_g):
                w = sc[p] * v_s[p, kh, gi]
                for j in range(g):
                    acc[gi * g + j] += w * np.float32(v_q[p, kh, gi * g + j])


@njit(cache=True, nogil=True, inline="always")
def _softmax_inplace(sc):
    m = sc[0]
    for p in range(1, sc.shape[0]):
        m = max(m, sc[p])
    total = np.float32(0.0)
    for p in range(sc.shape[0]):
        e = np.float32(np.exp(sc[p] - m))
        sc[p] = e
        total += e
    inv = np.float32(1.0) / total
    for p in range(sc.shape[0]):
        sc[p] *= inv


def attention_f16(out, q, k_cache, v_cache, pos0, scale):
    """out (T, H, hd) <- softmax(q K^T * scale) V, causal, GQA. q (T, H, hd) f32; caches (cap, n_kv, hd) f16."""
    _attn_f16(out, q, k_cache.view(np.uint16), v_cache.view(np.uint16), pos0, np.float32(scale))


def attention_int8(out, q, k_q, k_s, v_q, v_s, pos0, scale):
    """As attention_f16 over an int8 cache: k_q, v_q (cap, n_kv, hd) int8; k_s, v_s (cap, n_kv, hd//g) f32."""
    _attn_int8(out, q, k_q, k_s, v_q, v_s, pos0, np.float32(scale))
