"""CPU kernels (numba @njit): same names, signatures and meaning as `ref.py`.

Each public kernel is a thin Python function that picks a jitted implementation (`_name` below) from the
prepared weight's kind or the array dtypes; all loops run in numba. First version: correct and reasonably
fast, structured so the speed issue can swap implementations behind the same names.

Weight layout (`prepare_weight`): quants and scales are split apart at load time.
- Q8_0: qs int8 (d, nb, 32), scale f32 (d, nb)                      x = d * q
- Q4_0: qs uint8 (d, nb, 16) (raw nibble bytes), scale f32 (d, nb)  x = d * (q - 8)
- Q4_1: qs uint8 (d, nb, 16), scale f32 (d, nb), min f32 (d, nb)    x = d * q + m
- everything else (F32, F16, BF16, Q4_K, Q6_K): dequantized ONCE to dense f32 (d, n). Simple but 4-8x the
  file's memory for those types; a native Q4_K/Q6_K kernel is future work.
The quantized matmuls dequantize one weight row at a time into a per-thread f32 buffer and dot it with
all T activation rows (float activations; int8 activations are the speed issue's business).

float16 KV caches are passed to numba as their uint16 bit patterns (numba has no CPU float16).
"""
from __future__ import annotations

try:  # numba flags (SLP vectorizer on, workqueue threads, flag-keyed cache) before numba is imported
    from .. import numba_env  # noqa: F401
except ImportError:  # pragma: no cover
    pass

import numpy as np
from gguf import GGMLQuantizationType as QT
from numba import njit, prange

from ..quant import QK, QTensor, dequantize, validate
from .ref import KV_GROUP, kv_group  # noqa: F401  (re-exported: same constants in every kernel module)

_F16_DENORM_SCALE = np.float32(2.0 ** 112)  # half -> float: shift the bits into place, then rescale


class CpuWeight:
    """A weight in the CPU layout (see module docstring). kind: 'q8_0' | 'q4_0' | 'q4_1' | 'dense'."""

    def __init__(self, name, kind, shape, qs=None, scale=None, mins=None, dense=None):
        self.name, self.kind, self.shape = name, kind, shape
        self.qs = qs  # (d, nb, 32) int8 or (d, nb, 16) uint8
        self.scale = scale  # (d, nb) f32
        self.mins = mins  # (d, nb) f32 (Q4_1 only)
        self.dense = dense  # (d, n) f32 (dense kind only)


class CpuScratch:
    """matmul scratch (unused by this version's kernels; kept so faster kernels can keep quantized
    activations here without changing the signature)."""

    def __init__(self, max_t: int, max_n: int):
        self.max_t, self.max_n = max_t, max_n


def prepare_weight(qt: QTensor) -> CpuWeight:
    """Repack a file tensor into the CPU layout (called once at load time)."""
    validate(qt)
    rows, cols = qt.shape[0], qt.shape[-1]
    shape = (rows, cols) if len(qt.shape) > 1 else (1, cols)
    if qt.qtype in (QT.Q8_0, QT.Q4_0, QT.Q4_1):
        raw = np.ascontiguousarray(qt.data).view(np.uint8).reshape(shape[0], cols // QK, -1)  # (d, nb, B)
        scale = np.ascontiguousarray(raw[:, :, 0:2]).view(np.float16)[..., 0].astype(np.float32)
        if qt.qtype == QT.Q8_0:
            qs = np.ascontiguousarray(raw[:, :, 2:]).view(np.int8)
            return CpuWeight(qt.name, "q8_0", shape, qs=qs, scale=scale)
        if qt.qtype == QT.Q4_0:
            return CpuWeight(qt.name, "q4_0", shape, qs=np.ascontiguousarray(raw[:, :, 2:]), scale=scale)
        mins = np.ascontiguousarray(raw[:, :, 2:4]).view(np.float16)[..., 0].astype(np.float32)
        return CpuWeight(qt.name, "q4_1", shape, qs=np.ascontiguousarray(raw[:, :, 4:]), scale=scale, mins=mins)
    dense = np.ascontiguousarray(dequantize(qt).reshape(shape), dtype=np.float32)
    return CpuWeight(qt.name, "dense", shape, dense=dense)


def weight_shape(w: CpuWeight) -> tuple[int, int]:
    """Logical (rows, cols) = (out_features, in_features) of a prepared weight."""
    return w.shape


def new_scratch(max_t: int, max_n: int) -> CpuScratch:
    """Scratch for `matmul` covering x of up to (max_t, max_n)."""
    return CpuScratch(max_t, max_n)


# ----------------------------------------------------------------------------------------------- linear
# Rows are split into chunks of _ROWS; a thread dequantizes one weight row at a time into its own f32 row
# buffer (vectorizable), then takes the T dot products with it (vectorizable), so each block is read once.
_ROWS = 16


@njit(cache=True, parallel=True, fastmath=True)
def _mm_q8_0(out, x, qs, scale):
    # out (T, d) <- x (T, n) @ W^T; W = scale (d, nb) * qs (d, nb, 32) int8
    d_rows, nb = scale.shape
    n, t_n = nb * 32, x.shape[0]
    for c in prange((d_rows + _ROWS - 1) // _ROWS):
        buf = np.empty(n, np.float32)  # one dequantized row
        for r in range(c * _ROWS, min(d_rows, (c + 1) * _ROWS)):
            for b in range(nb):
                d = scale[r, b]
                for j in range(32):
                    buf[b * 32 + j] = np.float32(qs[r, b, j]) * d
            for t in range(t_n):
                s = np.float32(0.0)
                for i in range(n):
                    s += buf[i] * x[t, i]
                out[t, r] = s


@njit(cache=True, parallel=True, fastmath=True)
def _mm_q4(out, x, qs, scale, mins, offset):
    # out (T, d) <- x (T, n) @ W^T for 4-bit blocks: value = scale * q + mins (Q4_1, offset=0), or
    # scale * (q - 8) (Q4_0: offset=8, mins ignored). Nibbles: lo = values 0..15, hi = 16..31 of a block.
    d_rows, nb = scale.shape
    n, t_n = nb * 32, x.shape[0]
    for c in prange((d_rows + _ROWS - 1) // _ROWS):
        buf = np.empty(n, np.float32)
        for r in range(c * _ROWS, min(d_rows, (c + 1) * _ROWS)):
            for b in range(nb):
                d = scale[r, b]
                m = mins[r, b] if offset == 0 else np.float32(-offset) * d
                for j in range(16):
                    q = qs[r, b, j]
                    buf[b * 32 + j] = np.float32(q & 15) * d + m
                    buf[b * 32 + 16 + j] = np.float32(q >> 4) * d + m
            for t in range(t_n):
                s = np.float32(0.0)
                for i in range(n):
                    s += buf[i] * x[t, i]
                out[t, r] = s


@njit(cache=True, parallel=True, fastmath=True)
def _mm_dense(out, x, w):
    # out (T, d) <- x (T, n) @ w (d, n)^T
    t_n, n = x.shape
    for r in prange(w.shape[0]):
        for t in range(t_n):
            s = np.float32(0.0)
            for j in range(n):
                s += w[r, j] * x[t, j]
            out[t, r] = s


def matmul(out, x, w, scratch):
    """out (T, d) f32 <- x (T, n) f32 @ W (d, n)^T. One pass over W serves all T rows."""
    if w.kind == "q8_0":
        _mm_q8_0(out, x, w.qs, w.scale)
    elif w.kind == "q4_1":
        _mm_q4(out, x, w.qs, w.scale, w.mins, 0)
    elif w.kind == "q4_0":
        _mm_q4(out, x, w.qs, w.scale, w.scale, 8)
    else:
        _mm_dense(out, x, w.dense)


@njit(cache=True)
def _embed_q8_0(out, qs, scale, tokens):
    for t in range(tokens.shape[0]):
        r = tokens[t]
        for b in range(qs.shape[1]):
            for j in range(32):
                out[t, b * 32 + j] = scale[r, b] * np.float32(qs[r, b, j])


@njit(cache=True)
def _embed_q4(out, qs, scale, mins, offset, tokens):
    has_min = offset == 0
    for t in range(tokens.shape[0]):
        r = tokens[t]
        for b in range(qs.shape[1]):
            d = scale[r, b]
            m = mins[r, b] if has_min else np.float32(-offset) * d
            for j in range(16):
                q = qs[r, b, j]
                out[t, b * 32 + j] = d * np.float32(q & 15) + m
                out[t, b * 32 + 16 + j] = d * np.float32(q >> 4) + m


@njit(cache=True)
def _embed_dense(out, w, tokens):
    for t in range(tokens.shape[0]):
        out[t, :] = w[tokens[t]]


def embed(out, w, tokens):
    """out (T, n) f32 <- rows tokens (T,) int32 of the embedding table W (vocab, n)."""
    if w.kind == "q8_0":
        _embed_q8_0(out, w.qs, w.scale, tokens)
    elif w.kind == "q4_1":
        _embed_q4(out, w.qs, w.scale, w.mins, 0, tokens)
    elif w.kind == "q4_0":
        _embed_q4(out, w.qs, w.scale, w.scale, 8, tokens)
    else:
        _embed_dense(out, w.dense, tokens)


@njit(cache=True)
def bias_add(out, b):
    """out (T, n) += b (n,) f32."""
    for t in range(out.shape[0]):
        for i in range(out.shape[1]):
            out[t, i] += b[i]


@njit(cache=True)
def residual_add(out, x):
    """out (T, n) += x (T, n)."""
    for t in range(out.shape[0]):
        for i in range(out.shape[1]):
            out[t, i] += x[t, i]


# ------------------------------------------------------------------------------------------ elementwise
@njit(cache=True)
def rmsnorm(out, x, w, eps):
    """out (R, n) <- x (R, n) / sqrt(mean(x^2) + eps) * w (n,)."""
    n = x.shape[1]
    for r in range(x.shape[0]):
        ss = 0.0  # float64 accumulator: exact enough to match ref for any n
        for i in range(n):
            ss += np.float64(x[r, i]) * x[r, i]
        inv = np.float32(1.0 / np.sqrt(ss / n + eps))
        for i in range(n):
            out[r, i] = x[r, i] * inv * w[i]


@njit(cache=True, fastmath=True)
def swiglu(out, gate, up):
    """out (T, f) <- silu(gate (T, f)) * up (T, f)."""
    for t in range(out.shape[0]):
        for i in range(out.shape[1]):
            g = gate[t, i]
            out[t, i] = g / (np.float32(1.0) + np.exp(-g)) * up[t, i]


@njit(cache=True)
def rope(x, pos0, inv_freq, neox):
    """Rotate x (T, H, hd) in place, row t at position pos0 + t (pairs: halves if neox, else adjacent)."""
    t_n, n_head, hd = x.shape
    half = hd // 2
    for t in range(t_n):
        for i in range(half):
            ang = np.float64(pos0 + t) * np.float64(inv_freq[i])
            c, s = np.cos(ang), np.sin(ang)
            ia, ib = (i, i + half) if neox else (2 * i, 2 * i + 1)
            for h in range(n_head):
                a, b = np.float64(x[t, h, ia]), np.float64(x[t, h, ib])
                x[t, h, ia] = a * c - b * s
                x[t, h, ib] = a * s + b * c


@njit(cache=True)
def argmax(out, logits):
    """out (T,) int32 <- index of the largest value of each row of logits (T, vocab) (first on ties)."""
    for t in range(logits.shape[0]):
        best, bi = logits[t, 0], 0
        for i in range(1, logits.shape[1]):
            if logits[t, i] > best:
                best, bi = logits[t, i], i
        out[t] = bi


# ---------------------------------------------------------------------------------------------- KV cache
def kv_store_f16(k_cache, v_cache, k, v, pos0):
    """k_cache, v_cache (cap, n_kv, hd) f16 [pos0 : pos0+T] <- k, v (T, n_kv, hd) f32."""
    t_n = k.shape[0]
    k_cache[pos0:pos0 + t_n] = k  # numpy's cast rounds to nearest even, like ref
    v_cache[pos0:pos0 + t_n] = v


@njit(cache=True)
def _quant_rows(q, s, x, pos0):
    # q (cap, n_kv, hd) int8, s (cap, n_kv, hd//g) f32 [pos0+t] <- x (T, n_kv, hd); see ref.quantize_kv_int8
    group = x.shape[2] // s.shape[2]
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


@njit(cache=True, inline="always")
def _h2f(h):
    # IEEE half bits (uint16) -> float32; exact for finite values incl. subnormals
    f = np.uint32((np.uint32(h) & np.uint32(0x7FFF)) << np.uint32(13)).view(np.float32) * _F16_DENORM_SCALE
    return -f if (h & 0x8000) else f


@njit(cache=True, parallel=True, fastmath=True)
def _attn(out, q, k_c, v_c, k_s, v_s, is_int8, pos0, scale):
    # out (T, H, hd) <- causal GQA attention of q (T, H, hd) over cache positions 0..pos0+t.
    # f16 cache: k_c, v_c (cap, n_kv, hd) uint16 bits (k_s, v_s unused); int8: k_c, v_c int8 + scales.
    # One pass with an online softmax (running max m and sum l); out[t, h] is the accumulator.
    t_n, n_head, hd = q.shape
    group = n_head // k_c.shape[1]
    sg = hd // k_s.shape[2] if is_int8 else hd
    for th in prange(t_n * n_head):
        t, h = th // n_head, th % n_head
        kh = h // group
        acc = out[t, h]
        acc[:] = 0.0
        m = -np.inf
        lsum = np.float32(0.0)
        for p in range(pos0 + t + 1):
            sc = np.float32(0.0)
            if is_int8:
                for g in range(hd // sg):
                    part = np.float32(0.0)
                    for j in range(g * sg, (g + 1) * sg):
                        part += q[t, h, j] * np.float32(k_c[p, kh, j])
                    sc += part * k_s[p, kh, g]
            else:
                for j in range(hd):
                    sc += q[t, h, j] * _h2f(k_c[p, kh, j])
            sc *= scale
            if sc > m:  # new max: rescale what was accumulated so far
                corr = np.float32(np.exp(m - sc))
                lsum *= corr
                for j in range(hd):
                    acc[j] *= corr
                m = sc
            pw = np.float32(np.exp(sc - m))
            lsum += pw
            if is_int8:
                for j in range(hd):
                    acc[j] += pw * v_s[p, kh, j // sg] * np.float32(v_c[p, kh, j])
            else:
                for j in range(hd):
                    acc[j] += pw * _h2f(v_c[p, kh, j])
        inv = np.float32(1.0) / lsum
        for j in range(hd):
            acc[j] *= inv


_NO_SCALES = np.zeros((1, 1, 1), np.float32)


def attention_f16(out, q, k_cache, v_cache, pos0, scale):
    """out (T, H, hd) <- softmax(q K^T * scale) V, causal, GQA. q (T, H, hd) f32; caches (cap, n_kv, hd) f16."""
    _attn(out, q, k_cache.view(np.uint16), v_cache.view(np.uint16), _NO_SCALES, _NO_SCALES, False,
          pos0, np.float32(scale))


def attention_int8(out, q, k_q, k_s, v_q, v_s, pos0, scale):
    """As attention_f16 over an int8 cache: k_q, v_q (cap, n_kv, hd) int8; k_s, v_s (cap, n_kv, hd//g) f32."""
    _attn(out, q, k_q, v_q, k_s, v_s, True, pos0, np.float32(scale))
