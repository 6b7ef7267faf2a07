"""Device weight layouts for the cuda backend, the host-side repacking into them, and their matmul/embed kernels.

Every GGUF type is repacked once at load time (numpy, on the host) into one of four device formats, so the
kernels only know four decoders instead of seven:

  q4   (Q4_0, Q4_1, Q4_K): per 32-value block b of a row, 4 uint32 words of nibbles (byte i of the block:
       low nibble = value i, high nibble = value i+16) plus one f32 scale and one f32 min; x = scale*q + min.
       Q4_0: min = -8*d; Q4_K: scale = d*sc[j], min = -dmin*mn[j] per 32-value sub-block j.
  q8   (Q8_0, Q6_K): int8 values packed 4 per int32 word, one f32 scale per group of G values (G = 32 for
       Q8_0, 16 for Q6_K where q = q6 - 32 and scale = d*scales[j]); x = scale*q.
  f16, f32 (F16, F32, BF16 -> f32; Q5_0, Q5_1, Q5_K -> f32 for now: no decoder of their own): dense.

The matmul kernels read the weight once per tile of up to TT activation rows (one accumulator per row; the
tile loops have the constant trip count TT, guarded by `t < tn`, so LLVM unrolls them and keeps the
accumulators in registers instead of local memory) and reduce the per-lane partial sums through shared memory: no warp shuffles, so the same
code runs under the CUDA simulator (which has none).
"""
from __future__ import annotations

import math

import numpy as np
from ...gguf_types import GGMLQuantizationType as QT
from numba import cuda, float32, int32, int64, uint32
from numba.types import float16

from ...quant import QTensor, _raw_rows, _f16, _q4k_scales, block_info, dequantize, validate

TT = 8  # activation rows per matmul tile (weights are decoded once per tile)
MAX_BLOCK = 128  # threads per block the shared-memory reductions are sized for
_SM = MAX_BLOCK * TT  # shared floats of a matmul block (lane partials per row slot and tile row)

Q4, Q8, F16, F32 = 0, 1, 2, 3


class CudaWeight:
    """A weight in its device format. `shape` = logical (rows, cols); arrays live on the device."""

    def __init__(self, name, qtype, shape, fmt, arrays, group=32):
        self.name = name
        self.qtype = qtype
        self.shape = tuple(shape)
        self.fmt = fmt  # Q4 | Q8 | F16 | F32
        self.group = group  # values per scale (q8 only)
        self.arrays = arrays  # q4: (qw u32 (d, n/8), sc f32 (d, n/32), mn f32 (d, n/32)); q8: (qw i32 (d, n/4),
        #                       sc f32 (d, n/G)); f16/f32: (w (d, n),)

    @property
    def nbytes(self) -> int:
        return sum(int(a.size) * a.dtype.itemsize for a in self.arrays)


# ------------------------------------------------------------------------------------- host repacking
def _pack_q4(q, scale, mn):
    """q uint8 (d, nb, 32) values 0..15, scale/mn f32 (d, nb) -> host arrays of the q4 format."""
    d, nb, _ = q.shape
    byte = (q[:, :, :16] | (q[:, :, 16:] << 4)).astype(np.uint8)  # (d, nb, 16)
    qw = np.ascontiguousarray(byte).view(np.uint32).reshape(d, nb * 4)
    return qw, np.ascontiguousarray(scale, np.float32), np.ascontiguousarray(mn, np.float32)


def repack(qt: QTensor):
    """QTensor -> (fmt, group, host arrays) of the device format (see the module docstring)."""
    validate(qt)
    rows, cols = (qt.shape[0], qt.shape[1]) if len(qt.shape) == 2 else (1, qt.shape[0])
    bs, bb = block_info(qt.qtype, qt.name)
    raw = _raw_rows(qt).reshape(rows, -1)
    if qt.qtype == QT.F32:
        return F32, 1, (np.ascontiguousarray(raw).view(np.float32).reshape(rows, cols),)
    if qt.qtype == QT.F16:
        return F16, 1, (np.ascontiguousarray(raw).view(np.float16).reshape(rows, cols),)
    if qt.qtype == QT.BF16:
        u = np.ascontiguousarray(raw).view(np.uint16).astype(np.uint32) << 16
        return F32, 1, (u.view(np.float32).reshape(rows, cols),)
    nb = cols // bs
    blk = raw.reshape(rows, nb, bb)
    if qt.qtype in (QT.Q4_0, QT.Q4_1):
        d = _f16(blk[:, :, 0:2])  # (rows, nb)
        off = 2 if qt.qtype == QT.Q4_0 else 4
        qs = blk[:, :, off:off + 16]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # (rows, nb, 32)
        mn = -8.0 * d if qt.qtype == QT.Q4_0 else _f16(blk[:, :, 2:4])
        return Q4, 32, _pack_q4(q, d, mn)
    if qt.qtype == QT.Q4_K:
        d, dmin = _f16(blk[:, :, 0:2]), _f16(blk[:, :, 2:4])  # (rows, nb)
        sc, mn = _q4k_scales(blk[:, :, 4:16].reshape(rows * nb, 12))  # (rows*nb, 8)
        sc, mn = sc.reshape(rows, nb, 8), mn.reshape(rows, nb, 8)
        qs = blk[:, :, 16:].reshape(rows, nb, 4, 32)  # 4 chunks of 64 values: lo nibbles, then hi
        q = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(rows, nb * 8, 32)  # sub-block j of 32
        scale = (d[:, :, None] * sc).reshape(rows, nb * 8)
        mins = -(dmin[:, :, None] * mn).reshape(rows, nb * 8)
        return Q4, 32, _pack_q4(q, scale, mins)
    if qt.qtype == QT.Q8_0:
        d = _f16(blk[:, :, 0:2])  # (rows, nb)
        q = np.ascontiguousarray(blk[:, :, 2:]).reshape(rows, cols)
        return Q8, 32, (q.view(np.int32).reshape(rows, cols // 4), np.ascontiguousarray(d, np.float32))
    if qt.qtype == QT.Q6_K:
        ql = blk[:, :, 0:128].reshape(rows, nb, 2, 64)
        qh = blk[:, :, 128:192].reshape(rows, nb, 2, 32)
        sc = blk[:, :, 192:208].copy().view(np.int8).astype(np.float32)  # (rows, nb, 16)
        d = _f16(blk[:, :, 208:210])  # (rows, nb)
        lo = np.stack([ql[..., :32] & 0x0F, ql[..., 32:] & 0x0F, ql[..., :32] >> 4, ql[..., 32:] >> 4], 3)
        hi = np.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=3)
        q = ((lo | (hi << 4)).astype(np.int16) - 32).astype(np.int8).reshape(rows, cols)
        scale = (d[:, :, None] * sc).reshape(rows, nb * 16)
        return Q8, 16, (q.view(np.int32).reshape(rows, cols // 4), np.ascontiguousarray(scale, np.float32))
    if qt.qtype in (QT.Q5_0, QT.Q5_1, QT.Q5_K):  # no device decoder yet: the reference's f32 values (exact)
        return F32, 1, (np.ascontiguousarray(dequantize(qt).reshape(rows, cols), np.float32),)
    raise AssertionError(qt.qtype)


def prepare_weight(qt: QTensor) -> CudaWeight:
    """Repack a file tensor and copy it to the current device (called once at load time)."""
    fmt, group, host = repack(qt)
    rows, cols = (qt.shape[0], qt.shape[1]) if len(qt.shape) == 2 else (1, qt.shape[0])
    return CudaWeight(qt.name, qt.qtype, (rows, cols), fmt, tuple(cuda.to_device(a) for a in host), group)


def slice_rows(w: CudaWeight, start: int, stop: int) -> CudaWeight:
    """Rows start..stop of a device weight as a new (copied) weight: TP shards of output dimensions."""
    arrs = tuple(cuda.to_device(a.copy_to_host()[start:stop]) for a in w.arrays)
    return CudaWeight(w.name, w.qtype, (stop - start, w.shape[1]), w.fmt, arrs, w.group)


# ------------------------------------------------------------------------------------------- decoders
@cuda.jit(device=True, inline=True)
def _q4_value(qw, sc, mn, row, j):
    # value j of a q4 row: block b, byte (j % 16), nibble lo for j%32 < 16
    b = j // 32
    i = j % 32
    k = i % 16
    w = qw[row, b * 4 + k // 4]
    nib = (w >> uint32(8 * (k % 4) + 4 * (i // 16))) & uint32(15)
    return sc[row, b] * float32(nib) + mn[row, b]


@cuda.jit(device=True, inline=True)
def _q8_value(qw, sc, group, row, j):
    w = qw[row, j // 4]
    v = (w >> int32(8 * (j % 4))) & int32(255)
    v = v - ((v & int32(128)) << int32(1))  # sign-extend the byte
    return sc[row, j // group] * float32(v)


@cuda.jit(device=True, inline=True)
def _reduce_rows_store(acc, sm, red, out, row, n_rows, t0, tn, lane, r, nl, epi):
    # sm (_SM,): lane partials of each (row slot r, t); lane 0 sums them. Epilogue `epi`:
    #   0: out[t0+t, row] = sum   1: out[t0+t, row] += sum (residual fused; out is not an input)
    #   2: rows come in (gate, up) pairs (even slot, odd slot): out[t0+t, row // 2] = silu(gate) * up
    base = (r * nl + lane) * TT
    for t in range(TT):
        sm[base + t] = acc[t]
    cuda.syncthreads()
    if lane == 0 and row < n_rows:
        for t in range(TT):
            if t < tn:
                s = float32(0.0)
                for ln in range(nl):
                    s += sm[(r * nl + ln) * TT + t]
                if epi == 0:
                    out[t0 + t, row] = s
                elif epi == 1:
                    out[t0 + t, row] += s
                else:
                    red[r * TT + t] = s
    if epi == 2:
        cuda.syncthreads()
        if lane == 0 and row < n_rows and r % 2 == 0:
            for t in range(TT):
                if t < tn:
                    g = red[r * TT + t]
                    out[t0 + t, row // 2] = g / (float32(1.0) + math.exp(-g)) * red[(r + 1) * TT + t]


# -------------------------------------------------------------------------------------------- matmul
# Launch: block (nl lanes, nr rows), grid (ceil(d / nr), ceil(T / TT)). Lane `lane` of row slot r walks the
# blocks lane, lane+nl, ... of weight row `row`; out (T, d) f32 (d/2 with epi 2), x (T, n) f32.
def matmul_q4(out, x, qw, sc, mn, epi):
    lane = cuda.threadIdx.x
    r = cuda.threadIdx.y
    nl = cuda.blockDim.x
    row = cuda.blockIdx.x * cuda.blockDim.y + r
    t0 = cuda.blockIdx.y * TT
    tn = min(TT, x.shape[0] - t0)
    acc = cuda.local.array(TT, float32)
    sq = cuda.local.array(TT, float32)
    sx = cuda.local.array(TT, float32)
    sm = cuda.shared.array(_SM, float32)
    red = cuda.shared.array(_SM, float32)
    for t in range(TT):
        acc[t] = float32(0.0)
    n_rows = sc.shape[0]
    if row < n_rows:
        for b in range(lane, sc.shape[1], nl):
            for t in range(TT):
                sq[t] = float32(0.0)
                sx[t] = float32(0.0)
            for k in range(4):
                w = qw[row, b * 4 + k]
                for s in range(4):
                    lo = float32((w >> uint32(8 * s)) & uint32(15))
                    hi = float32((w >> uint32(8 * s + 4)) & uint32(15))
                    j0 = b * 32 + k * 4 + s
                    for t in range(TT):
                        if t < tn:
                            x0 = x[t0 + t, j0]
                            x1 = x[t0 + t, j0 + 16]
                            sq[t] += lo * x0 + hi * x1
                            sx[t] += x0 + x1
            s_b = sc[row, b]
            m_b = mn[row, b]
            for t in range(TT):
                acc[t] += s_b * sq[t] + m_b * sx[t]
    _reduce_rows_store(acc, sm, red, out, row, n_rows, t0, tn, lane, r, nl, epi)


def matmul_q8(out, x, qw, sc, group, epi):
    lane = cuda.threadIdx.x
    r = cuda.threadIdx.y
    nl = cuda.blockDim.x
    row = cuda.blockIdx.x * cuda.blockDim.y + r
    t0 = cuda.blockIdx.y * TT
    tn = min(TT, x.shape[0] - t0)
    acc = cuda.local.array(TT, float32)
    sq = cuda.local.array(TT, float32)
    sm = cuda.shared.array(_SM, float32)
    red = cuda.shared.array(_SM, float32)
    for t in range(TT):
        acc[t] = float32(0.0)
    n_rows = sc.shape[0]
    if row < n_rows:
        wpg = group // 4  # int32 words per scale group
        for g in range(lane, sc.shape[1], nl):
            for t in range(TT):
                sq[t] = float32(0.0)
            for k in range(wpg):
                w = qw[row, g * wpg + k]
                for s in range(4):
                    v = (w >> int32(8 * s)) & int32(255)
                    qv = float32(v - ((v & int32(128)) << int32(1)))
                    j = g * group + k * 4 + s
                    for t in range(TT):
                        if t < tn:
                            sq[t] += qv * x[t0 + t, j]
            s_g = sc[row, g]
            for t in range(TT):
                acc[t] += s_g * sq[t]
    _reduce_rows_store(acc, sm, red, out, row, n_rows, t0, tn, lane, r, nl, epi)


def matmul_dense(out, x, w, epi):
    lane = cuda.threadIdx.x
    r = cuda.threadIdx.y
    nl = cuda.blockDim.x
    row = cuda.blockIdx.x * cuda.blockDim.y + r
    t0 = cuda.blockIdx.y * TT
    tn = min(TT, x.shape[0] - t0)
    acc = cuda.local.array(TT, float32)
    sm = cuda.shared.array(_SM, float32)
    red = cuda.shared.array(_SM, float32)
    for t in range(TT):
        acc[t] = float32(0.0)
    n_rows = w.shape[0]
    if row < n_rows:
        for j in range(lane, w.shape[1], nl):
            wv = float32(w[row, j])
            for t in range(TT):
                if t < tn:
                    acc[t] += wv * x[t0 + t, j]
    _reduce_rows_store(acc, sm, red, out, row, n_rows, t0, tn, lane, r, nl, epi)


# --------------------------------------------------------------------------------------------- embed
# Launch: grid (T, ceil(n / nthreads)); out (T, n) f32 <- row tokens[t] of the table.
def embed_q4(out, qw, sc, mn, tokens):
    t = cuda.blockIdx.x
    j = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    if j < out.shape[1]:
        out[t, j] = _q4_value(qw, sc, mn, tokens[t], j)


def embed_q8(out, qw, sc, group, tokens):
    t = cuda.blockIdx.x
    j = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    if j < out.shape[1]:
        out[t, j] = _q8_value(qw, sc, group, tokens[t], j)


def embed_dense(out, w, tokens):
    t = cuda.blockIdx.x
    j = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    if j < out.shape[1]:
        out[t, j] = float32(w[tokens[t], j])


_f32_2 = float32[:, :]
_tok = int32[:]
# name -> (python function, explicit signatures): compiled lazily by cuda.py, type-checked by compile_ptx tests
KERNELS = {
    "matmul_q4": (matmul_q4, [(_f32_2, _f32_2, uint32[:, :], _f32_2, _f32_2, int64)]),
    "matmul_q8": (matmul_q8, [(_f32_2, _f32_2, int32[:, :], _f32_2, int64, int64)]),
    "matmul_dense": (matmul_dense, [(_f32_2, _f32_2, _f32_2, int64), (_f32_2, _f32_2, float16[:, :], int64)]),
    "embed_q4": (embed_q4, [(_f32_2, uint32[:, :], _f32_2, _f32_2, _tok)]),
    "embed_q8": (embed_q8, [(_f32_2, int32[:, :], _f32_2, int64, _tok)]),
    "embed_dense": (embed_dense, [(_f32_2, _f32_2, _tok), (_f32_2, float16[:, :], _tok)]),
}
