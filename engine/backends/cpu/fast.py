"""Fast CPU kernels: row-interleaved quantized weights x int8-quantized activations (the `ref.py` contract).

Only `prepare_weight`, `weight_shape`, `new_scratch` (fast_weights.py: the weights repacked), `matmul`, `embed`
and `swiglu` differ from `cpu.py`; every other kernel is cpu.py's. Q4_K takes the 4-bit layout with its 6-bit
scales (q4k.py), Q5_0 / Q5_1 / Q5_K / Q6_K kquant.py's 5- and 6-bit layouts (its kernels, same contract); weights
of other types keep cpu.py's layout and kernels, so this module is a drop-in superset.

Why this layout (measured on a 2-core Zen 3, AVX2; REFERENCE.md section 8 for the Zen 4 prototype):
- Rows are interleaved in groups of G=32: blocks[group, block] holds one block (32 values) of all G rows
  of a group, its nibbles and then the rows' scales and mins (640 bytes, one contiguous read: avx2's
  docstring). The kernels keep one accumulator per row in vector lanes (no per-block horizontal sums).
- The activation row is quantized once per matmul to int8 with one f32 scale per 32-block (Q8 style), and
  the block dot product is integer: Q4_1 is sum_j (d q_j + m) x_j ~ (d * sa) * sum_j (q_j - 8) qa_j +
  (m + 8 d) * xs (xs: the f16 block sum of the quantized row), the dot with the quantized row as llama.cpp
  computes it (see quantize_rows), in the form where xs's rounding nearly cancels (avx2._block_term).
  The generic kernels accumulate (q - 8) qa in int16 (|sum| <= 32 * 8 * 127 = 32512, 16 lanes per AVX2
  register); the AVX2 ones sum the unsigned nibbles and subtract 8 sum_j qa_j: the same integer.
- Scales and mins are the file's f16 bits per (group, block, row), after the block's nibbles: read once per
  block, vectorized over rows (vcvtph2ps), so the weight stream is the file's bytes (Q4_1: 20 per row and
  block), one stream per thread.
- Within a block, bytes are ordered for avx2's vpmaddubsw (see its docstring): a byte holds the same
  value of two rows 8 apart, four consecutive values of a row are adjacent.
- Explicit np.int16 casts everywhere: numba otherwise promotes int16 arithmetic to int64 lanes.
- T > 1 (prefill chunk, speculative verify): the group's block stays in L1 while all T rows use it, so every
  weight byte comes from memory once per call ("each weight block is read once for all T").
- On AVX2 hosts (HAVE_AVX2) quantize_rows, q4_group / q4_group_batched / q8_group and the T > 1 Q8_0 head
  run the kernels of avx2.py (LLVM IR: vpmaddubsw on unsigned nibbles, 32 multiply-adds per
  instruction; the batched forms unpack each block once into a 1-2 KiB L1 buffer). They compute the same integer block
  sums and the same float expression in the same order as the generic kernels (kept as *_generic), so
  results are bit-identical, and batched rows equal one-row calls. Measured (scripts/matmul_bench.py,
  SmolLM2 layers, 1 thread on a loaded machine, two runs): T=1 1.3-1.75x, T=8 2.2x, T=64 2.1x faster;
  Q8_0 head T=1 1.5-1.8x, T=8 3.5-3.7x, T=64 4.1x. The decode (T = 1) layer is compute-bound per thread
  (a layer alone in cache was no faster than 30 streaming ones); the byte order above (no shuffles, no
  widening) and outputs kept in registers across a group's blocks made it 0.18-0.22 -> 0.14-0.15 ms per
  layer on one thread (three alternating runs).
The loop vectorizer is what vectorizes these kernels here (the rows loop is innermost and contiguous); SLP
(numba_env) helps the scale/accumulate tails. tests/engine/test_speed_guard.py checks the emitted assembly.
"""
from __future__ import annotations

from ... import numba_env  # noqa: F401  (must precede the numba import: SLP flag, cache dir, threading layer)

import numba
import numpy as np
from numba import njit, prange

from ...quant import QK
from . import kernels as cpu
from . import avx2, avx2_q8
from .avx2 import XS, XS_A, XS_A0, XS_SCALED  # noqa: F401  (XS re-exported: the scratch width)
from . import kquant  # Q4_K, Q5_0, Q5_1, Q5_K, Q6_K (KWeight)
from .fast_weights import (  # noqa: F401  (the kernel set's weights and scratch: fast_weights.py)
    FastScratch, FastWeight, new_scratch, prepare_layers, prepare_weight, release_pages, repack, thread_parts,
    weight_shape)
from .attn import GENERIC_FORCED, exp_fast, h2f
from .layout import D8_OFF, D_OFF, G, M_OFF, nib_at, parts, val8_at  # noqa: F401  (re-exported)
from .target import target_has
from .kernels import (  # noqa: F401  (the rest of the kernel set is cpu.py's)
    KV_GROUP, argmax, bias_add, kv_group, kv_store_f16, kv_store_int8,
    residual_add, rmsnorm, rope)

# avx2's vpmaddubsw kernels, else the generic ones below (NINFER_CPU_GENERIC=1 forces those: attn)
HAVE_AVX2 = target_has("avx2") and not GENERIC_FORCED
ROWS_UNPACKED = 16  # up to this many rows avx2.grp_q4_rows / grp_q8_rows (no unpacked copy; probes/matmul_bench.py)
# With 512-bit vpdpbusd (avx2.VNNI512) the multi-row kernels beat the unpacked copy at any T. The 4-bit form
# (3072x1024, one thread, an AVX-512 Xeon): T = 32 1322 -> 755 us, T = 64 2088 -> 1385. The Q8_0 form with its
# sign-extended pairs did not (T = 64 2961 -> 3503); with vpdpbusd over the flipped bytes (avx2_q8._q8_isums_busd)
# it does: the 576 -> 49152 head, two threads, T = 32 7.9-8.7 -> 3.5-4.6 ms, T = 64 13.5-23.5 -> 6.2-8.8
# (probes/matmul_bench.py against the tree before, alternated).
ROWS_UNPACKED_Q4 = (1 << 30) if avx2.VNNI512 else ROWS_UNPACKED
ROWS_UNPACKED_Q8 = (1 << 30) if avx2.VNNI512 else ROWS_UNPACKED
BATCHED_MIN_T = 2  # from this many rows on, matmuls unpack each weight block once (q4_group_batched)
I16 = np.int16
I32 = np.int32
F32 = np.float32


# ------------------------------------------------------------------------------------ activation quant
@njit(cache=True, nogil=True, inline="always")
def _f16_round(v):
    # float32 -> the nearest float16 value (as float32), ties to even; normal f16 range (scales here)
    u = np.float32(v).view(np.uint32)
    u = np.uint32(u + np.uint32(0x0FFF) + ((u >> np.uint32(13)) & np.uint32(1)))
    return np.uint32(u & np.uint32(0xFFFFE000)).view(np.float32)


@njit(cache=True, nogil=True)
def quantize_rows(qa, sa, xs, x):
    """qa (T, n) int8, sa (T, nb) f32 scales, xs (T, XS nb) f32 <- x (T, n) f32 in 32-blocks, the way
    llama.cpp quantizes activations (Q8_1): d = amax / 127, q = round-half-even(x * 127 / amax), the scale
    kept as f16, and at xs[:, XS b + XS_SCALED] f16(d * sum(q)), the block sum of the *quantized* row; at
    XS_A sum(q) itself and at XS_A0 the sum of its first 16 (exact in f32: |.| <= 32 * 127), which the AVX2
    kernels' - 8 A term (Q6_K's - 32 A0 and - 32 A1) reads instead of summing the block again for every row
    group. With these the 4-bit dot
    d_w * d * sum((q_w - 8) q) + (m + 8 d_w) * xs equals llama.cpp's Q4_1 x Q8_1 dot, so greedy tokens
    follow llama.cpp's (measured by scripts/oracle_agreement.py)."""
    t_n, n = x.shape
    for t in range(t_n):
        for b in range(n // QK):
            amax = F32(0.0)
            for j in range(QK):
                amax = max(amax, abs(x[t, b * QK + j]))
            d = amax / F32(127.0)
            inv = F32(127.0) / amax if amax > 0 else F32(0.0)
            isum = 0
            half = 0
            for j in range(QK):
                q = np.int8(np.rint(x[t, b * QK + j] * inv))
                qa[t, b * QK + j] = q
                isum += np.int32(q)
                if j == QK // 2 - 1:
                    half = isum
            sa[t, b] = _f16_round(d)
            xs[t, XS * b + XS_SCALED] = _f16_round(d * F32(isum))
            xs[t, XS * b + XS_A] = F32(isum)
            xs[t, XS * b + XS_A0] = F32(half)


_quantize_rows_loop = quantize_rows  # the name quantize_rows_avx2 calls (quantize_rows is rebound below)


@njit(cache=True, nogil=True, error_model="numpy")
def quantize_rows_avx2(qa, sa, xs, x):
    """quantize_rows with each block's |x| max and its int8 values as vectors (avx2.absmax32, quant32):
    the same operations per value, so the same bits. In three passes over a row's blocks: the maxima (into
    sa), the scales and their inverses (into sa and xs: one vdivps for 8 blocks; error_model="numpy" keeps
    numba's division-by-zero check, a branch, out of that loop), then the values and sums. One block's
    chain (max, divisions, rounding, sum) is ~80 cycles of latency; blocks overlap when nothing ties them.
    ~0.1 instead of ~0.45 us for 576 values. Rows whose values are not adjacent in memory (never the
    engine's) go through the generic loop."""
    t_n, n = x.shape
    if n > 0 and t_n > 0 and (x.strides[1] != 4 or qa.strides[1] != 1):
        _quantize_rows_loop(qa, sa, xs, x)
        return
    nb = n // QK
    for t in range(t_n):
        xo, ao = t * (x.strides[0] // 4), t * qa.strides[0]
        for b in range(nb):
            sa[t, b] = avx2.absmax32(x, xo + b * QK)
        for b in range(nb):
            amax = sa[t, b]
            xs[t, XS * b] = F32(127.0) / amax if amax > 0 else F32(0.0)
            sa[t, b] = amax / F32(127.0)
        for b in range(nb):
            d = sa[t, b]
            a0, a1 = avx2.quant32(qa, ao + b * QK, x, xo + b * QK, xs[t, XS * b])
            isum = a0 + a1
            sa[t, b] = _f16_round(d)
            xs[t, XS * b + XS_SCALED] = _f16_round(d * F32(isum))
            xs[t, XS * b + XS_A] = F32(isum)
            xs[t, XS * b + XS_A0] = F32(a0)


if HAVE_AVX2:  # the generic loop stays as the reference and for other CPUs
    quantize_rows_generic, quantize_rows = quantize_rows, quantize_rows_avx2


# ----------------------------------------------------------------------------------------- matmul kernels
@njit(cache=True, nogil=True, inline="always")
def _snib(x, a):
    # ((low nibble - 8) * a, (high nibble - 8) * a) for one byte x (as int16), in int16
    return I16(I16(I16(x & I16(15)) - I16(8)) * a), I16(I16(I16(x >> I16(4)) - I16(8)) * a)


@njit(cache=True, nogil=True, inline="always")
def _q4_term(dbits, mbits, sb, xsb, s):
    # one block's contribution to one output: (d * sb) * s + (m + 8 d) * xsb, s = sum_j (q_j - 8) a_j;
    # avx2._block_term computes the same expression in the same order (and says why this form)
    dv = h2f(dbits)
    return (dv * sb) * F32(s) + (h2f(mbits) + F32(8.0) * dv) * xsb


@njit(cache=True, nogil=True, inline="always")
def _copy_partial(out, tmp, t, g):
    # the valid rows of a padded last group
    for r in range(out.shape[1] - g * G):
        out[t, g * G + r] = tmp[r]


@njit(cache=True, nogil=True, inline="always")
def _batched_target(out, g):
    """(full, part) for a batched AVX2 group kernel: a full group accumulates straight into out's rows (zeroed
    here); the padded last group into part (T, G), copied out by _copy_partial afterwards."""
    t_n = out.shape[0]
    full = (g + 1) * G <= out.shape[1]
    part = np.zeros((0 if full else t_n, G), np.float32)
    if full:
        for t in range(t_n):
            for r in range(G):
                out[t, g * G + r] = F32(0.0)
    return full, part


@njit(cache=True, nogil=True, inline="always")
def _bits(blk, g, b, i):
    # the uint16 at bytes i, i + 1 of block b of group g (a scale's or min's f16 bits; little-endian; blk uint8
    # or int8)
    lo, hi = np.uint16(np.uint8(blk[g, b, i])), np.uint16(np.uint8(blk[g, b, i + 1]))
    return np.uint16(lo | np.uint16(hi << np.uint16(8)))


@njit(cache=True, nogil=True, inline="always")
def _nib(blk, g, b, v, i):
    return blk[g, b, nib_at(v, i)]


@njit(cache=True, nogil=True, inline="always")
def _val8(blk, g, b, jp, i):
    return blk[g, b, val8_at(jp, i)]


@njit(cache=True, nogil=True, inline="always")
def _q4_block_term(blk, g, b, r, sb, xsb, s):
    # _q4_term of row r of block b of group g, its scale and min from the block
    return _q4_term(_bits(blk, g, b, D_OFF + 2 * r), _bits(blk, g, b, M_OFF + 2 * r), sb, xsb, s)


@njit(cache=True, nogil=True, inline="always")
def _q4_rows(o, qa, sa, xs, blk, acc, g, t):
    # o (G,) <- the G outputs of group g for activation row t (decode form). Layout: avx2's docstring
    # (vector 2k + h, byte 4r + e: value 4k + e of rows 16h + r (low nibble) and 16h + 8 + r (high)).
    for r in range(G):
        o[r] = F32(0.0)
    for b in range(blk.shape[1]):
        for r in range(G):
            acc[r] = 0
        for k in range(8):
            kk = b * QK + 4 * k
            a0, a1, a2, a3 = I16(qa[t, kk]), I16(qa[t, kk + 1]), I16(qa[t, kk + 2]), I16(qa[t, kk + 3])
            for h in range(2):
                for r in range(8):
                    l0, h0 = _snib(I16(_nib(blk, g, b, 2 * k + h, 4 * r)), a0)
                    l1, h1 = _snib(I16(_nib(blk, g, b, 2 * k + h, 4 * r + 1)), a1)
                    l2, h2 = _snib(I16(_nib(blk, g, b, 2 * k + h, 4 * r + 2)), a2)
                    l3, h3 = _snib(I16(_nib(blk, g, b, 2 * k + h, 4 * r + 3)), a3)
                    acc[16 * h + r] = I16(acc[16 * h + r] + I16(I16(l0 + l1) + I16(l2 + l3)))
                    acc[16 * h + 8 + r] = I16(acc[16 * h + 8 + r] + I16(I16(h0 + h1) + I16(h2 + h3)))
        for r in range(G):
            o[r] += _q4_block_term(blk, g, b, r, sa[t, b], xs[t, XS * b], acc[r])


@njit(cache=True, nogil=True)
def q4_group(out, qa, sa, xs, blk, acc, g):
    """Rows g*G .. g*G+G-1 of out (T, rows) for interleaved 4-bit W (see mm_q4); acc (G,) int16 scratch:
    sum_j (q_j - 8) a_j fits int16 (|.| <= 32 * 8 * 127), plus 8 sum_j a_j afterwards."""
    for t in range(out.shape[0]):
        if (g + 1) * G <= out.shape[1]:
            _q4_rows(out[t, g * G:(g + 1) * G], qa, sa, xs, blk, acc, g, t)
        else:  # last group of a padded weight
            tmp = np.empty(G, np.float32)
            _q4_rows(tmp, qa, sa, xs, blk, acc, g, t)
            _copy_partial(out, tmp, t, g)


@njit(cache=True, nogil=True)
def q4_group_batched(out, qa, sa, xs, blk, g):
    """As q4_group for T > 1: each block is unpacked once into wbuf (32, G) int16 (values - 8), then every
    row t only multiplies and adds (2 vector ops per 16 MACs instead of ~5). wbuf and acc are allocated
    here on purpose (2 small allocations per group and call): LLVM then knows they alias nothing and keeps
    the accumulators in vector registers; passed-in scratch of the same dtype defeated that (10x slower)."""
    t_n = out.shape[0]
    wbuf = np.empty((QK, G), np.int16)  # (32, G) the block's values - 8
    acc = np.empty(G, np.int16)  # (G,)
    full = (g + 1) * G <= out.shape[1]
    part = np.zeros((0 if full else t_n, G), np.float32)  # (T, G) last group of a padded weight only
    for b in range(blk.shape[1]):
        for k in range(8):
            for h in range(2):
                for r in range(8):
                    for e in range(4):
                        v = I16(_nib(blk, g, b, 2 * k + h, 4 * r + e))
                        wbuf[4 * k + e, 16 * h + r] = I16(I16(v & I16(15)) - I16(8))
                        wbuf[4 * k + e, 16 * h + 8 + r] = I16(I16(v >> I16(4)) - I16(8))
        for t in range(t_n):
            for r in range(G):
                acc[r] = 0
            for j in range(0, QK, 4):  # unrolled by 4: keeps LLVM from fully unrolling r (then it
                k = b * QK + j  # stays scalar) and lets the loop vectorizer take the r loop
                a0, a1, a2, a3 = I16(qa[t, k]), I16(qa[t, k + 1]), I16(qa[t, k + 2]), I16(qa[t, k + 3])
                for r in range(G):
                    s = I16(I16(wbuf[j, r] * a0) + I16(wbuf[j + 1, r] * a1))
                    s = I16(s + I16(I16(wbuf[j + 2, r] * a2) + I16(wbuf[j + 3, r] * a3)))
                    acc[r] = I16(acc[r] + s)
            o = out[t, g * G:(g + 1) * G] if full else part[t]
            if b == 0:
                for r in range(G):
                    o[r] = F32(0.0)
            for r in range(G):
                o[r] += _q4_block_term(blk, g, b, r, sa[t, b], xs[t, XS * b], acc[r])
    if not full:
        for t in range(t_n):
            _copy_partial(out, part[t], t, g)


@njit(cache=True, nogil=True, inline="always")
def _grp_q4(o, o0, qa, sa, xs, blk, g, t):
    # o[o0 : o0 + G] (flat) <- all blocks of group g for activation row t (avx2.grp_q4)
    avx2.grp_q4(o, o0, blk, g * blk.strides[0], qa, t * qa.strides[0], sa, xs, t * (sa.strides[0] // 4),
                    t * (xs.strides[0] // 4), blk.shape[1])


@njit(cache=True, nogil=True)
def q4_group_avx2(out, qa, sa, xs, blk, acc, g):
    """q4_group with the AVX2 group kernel (avx2.grp_q4: vpmaddubsw on the nibbles, outputs in registers
    across blocks); same integer block sums and float order, so bit-identical. acc is unused (same signature)."""
    for t in range(out.shape[0]):
        if (g + 1) * G <= out.shape[1]:
            _grp_q4(out, (t * out.strides[0]) // 4 + g * G, qa, sa, xs, blk, g, t)
        else:  # last group of a padded weight
            tmp = np.zeros(G, np.float32)
            _grp_q4(tmp, 0, qa, sa, xs, blk, g, t)
            _copy_partial(out, tmp, t, g)


@njit(cache=True, nogil=True, inline="always")
def _grp_q4_rows(o, o0, o_st, qa, sa, xs, blk, g, t, n):
    # rows t .. t + n - 1 (n <= avx2.ROWS_MAX) of o (flat offsets o0 + i o_st) <- all blocks of group g
    a0, ast = t * qa.strides[0], qa.strides[0]
    s0, sst = t * (sa.strides[0] // 4), sa.strides[0] // 4
    x0, xst = t * (xs.strides[0] // 4), xs.strides[0] // 4
    bo, nb = g * blk.strides[0], blk.shape[1]
    if n == 4:
        avx2.grp_q4_rows4(o, o0, o_st, blk, bo, qa, a0, ast, sa, xs, s0, sst, x0, xst, nb)
    elif n == 3:
        avx2.grp_q4_rows3(o, o0, o_st, blk, bo, qa, a0, ast, sa, xs, s0, sst, x0, xst, nb)
    elif n == 2:
        avx2.grp_q4_rows2(o, o0, o_st, blk, bo, qa, a0, ast, sa, xs, s0, sst, x0, xst, nb)
    else:
        avx2.grp_q4_rows1(o, o0, o_st, blk, bo, qa, a0, ast, sa, xs, s0, sst, x0, xst, nb)


@njit(cache=True, nogil=True)
def q4_group_batched_avx2(out, qa, sa, xs, blk, g):
    """q4_group_batched with the AVX2 kernels. Up to ROWS_UNPACKED_Q4 rows (a verify block, a short chunk; any T
    where the target has AVX512-VNNI):
    avx2.grp_q4_rows on ROWS_MAX rows at a time, each block's nibbles split once in registers for them (the
    group's blocks come from L1/L2 again for the next rows). More rows (a prompt chunk): each block's
    nibbles and its rows' scale terms are unpacked once (1.25 KiB, L1) and every activation row runs
    vpmaddubsw on them (avx2.unpack_q4 / blk_q4u). Both bit-identical to q4_group."""
    t_n = out.shape[0]
    if t_n <= ROWS_UNPACKED_Q4:
        if (g + 1) * G <= out.shape[1]:
            for t in range(0, t_n, avx2.ROWS_MAX):
                _grp_q4_rows(out, (t * out.strides[0]) // 4 + g * G, out.strides[0] // 4, qa, sa, xs, blk, g, t,
                             min(avx2.ROWS_MAX, t_n - t))
        else:  # last group of a padded weight
            part = np.zeros((t_n, G), np.float32)
            for t in range(0, t_n, avx2.ROWS_MAX):
                _grp_q4_rows(part, t * G, G, qa, sa, xs, blk, g, t, min(avx2.ROWS_MAX, t_n - t))
            for t in range(t_n):
                _copy_partial(out, part[t], t, g)
        return
    full, part = _batched_target(out, g)
    buf = np.empty(avx2.UNBUF, np.uint8)
    for b in range(blk.shape[1]):
        avx2.unpack_q4(buf, blk, g * blk.strides[0] + b * blk.strides[1])
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


if HAVE_AVX2:  # the generic kernels stay as the reference and for other CPUs
    q4_group_generic, q4_group_batched_generic = q4_group, q4_group_batched
    q4_group, q4_group_batched = q4_group_avx2, q4_group_batched_avx2


@njit(cache=True, nogil=True, inline="always")
def _q4(out, qa, sa, xs, blk, acc, j, g):
    # group j of blk into rows g * G.. of out (g = j unless blk is one part of a matrix: FastWeight),
    # choosing the decode (T = 1) or the batched form. A decode row's full group runs the AVX2 kernel in
    # the caller's code: a call of q4_group cost ~75 ns per group (its ~8 array arguments' reference
    # counts, incremented and decremented around every call), 35% of a group's time in L2
    if out.shape[0] >= BATCHED_MIN_T:
        q4_group_batched(out[:, (g - j) * G:], qa, sa, xs, blk, j)
    elif HAVE_AVX2 and out.shape[0] == 1 and (g + 1) * G <= out.shape[1]:
        _grp_q4(out, g * G, qa, sa, xs, blk, j, 0)
    else:
        q4_group(out[:, (g - j) * G:], qa, sa, xs, blk, acc, j)


@njit(cache=True, nogil=True)
def mm_q4(out, qa, sa, xs, blk, acc16):
    """out (T, rows) f32 <- x @ W^T for interleaved 4-bit W; x as qa (T, n) int8 + sa, xs (T, nb) f32.
    acc16 (ng, G) int16 scratch (decode). Each weight block is read once. Runs as mm_q4x3 with two empty
    weights: one parallel kernel to compile instead of three (cold start)."""
    mm_q4x3(out, out, out, qa, sa, xs, blk, acc16, blk[:0], acc16[:0], blk[:0], acc16[:0])


@njit(cache=True, nogil=True, parallel=True)
def mm_q4_parts(out, qa, sa, xs, blk, acc16):
    """mm_q4 for a layer matrix in parts (P, ng / P, nb, BLK4: prepare_layers): one parallel region over all
    its groups, group i being group i % h of part i // h."""
    h = blk.shape[1]
    for i in prange(blk.shape[0] * h):
        g = np.int64(i)
        _q4(out, qa, sa, xs, blk[g // h], acc16[g], g % h, g)


@njit(cache=True, nogil=True)
def mm_q4x2(out1, out2, qa, sa, xs, b1, acc1, b2, acc2):
    """Two matmuls of the same input (gate/up) in one parallel region: fewer thread wake-ups per step."""
    mm_q4x3(out1, out2, out2, qa, sa, xs, b1, acc1, b2, acc2, b2[:0], acc2[:0])


@njit(cache=True, nogil=True, parallel=True)
def mm_q4x3(out1, out2, out3, qa, sa, xs, b1, acc1, b2, acc2, b3, acc3):
    """Three matmuls of the same input (q/k/v) in one parallel region."""
    for g in prange(b1.shape[0] + b2.shape[0] + b3.shape[0]):
        mm_q4x3_part(np.int64(g), np.int64(g) + 1, out1, out2, out3, qa, sa, xs, b1, acc1, b2, acc2, b3, acc3)


@njit(cache=True, nogil=True)
def mm_q4x3_part(lo, hi, out1, out2, out3, qa, sa, xs, b1, acc1, b2, acc2, b3, acc3):
    """Items lo..hi of mm_q4x3 (row groups of the three weights, in order) on the calling thread. No
    parallel region: it compiles in a fraction of mm_q4x3's time (numba's parallel lowering re-optimizes
    every kernel it calls), so the start-up step (backends/cpu/tier.py) runs it on two Python threads."""
    n1, n2 = b1.shape[0], b2.shape[0]
    for g in range(lo, hi):
        if g < n1:
            _q4(out1, qa, sa, xs, b1, acc1[g], g, g)
        elif g < n1 + n2:
            _q4(out2, qa, sa, xs, b2, acc2[g - n1], g - n1, g - n1)
        else:
            _q4(out3, qa, sa, xs, b3, acc3[g - n1 - n2], g - n1 - n2, g - n1 - n2)


@njit(cache=True, nogil=True, inline="always")
def _q8_rows(o, qa, sa, blk, acc, g, t):
    # o (G,) <- the G outputs of group g for activation row t
    for r in range(G):
        o[r] = F32(0.0)
    for b in range(blk.shape[1]):
        for r in range(G):
            acc[r] = 0
        for jp in range(16):
            a0 = I32(qa[t, b * QK + 2 * jp])
            a1 = I32(qa[t, b * QK + 2 * jp + 1])
            for r in range(G):
                acc[r] += I32(_val8(blk, g, b, jp, 2 * r)) * a0 + I32(_val8(blk, g, b, jp, 2 * r + 1)) * a1
        sb = sa[t, b]
        for r in range(G):
            o[r] += (h2f(_bits(blk, g, b, D8_OFF + 2 * r)) * sb) * F32(acc[r])


@njit(cache=True, nogil=True)
def q8_group(out, qa, sa, blk, acc, g):
    """Rows g*G .. g*G+G-1 of out (T, rows) for interleaved Q8_0 W (see mm_q8); acc (G,) int32 scratch.
    Values 2i and 2i+1 of a row sit side by side, so LLVM turns the pair products into vpmaddwd."""
    for t in range(out.shape[0]):
        if (g + 1) * G <= out.shape[1]:
            _q8_rows(out[t, g * G:(g + 1) * G], qa, sa, blk, acc, g, t)
        else:  # last group of a padded weight
            tmp = np.empty(G, np.float32)
            _q8_rows(tmp, qa, sa, blk, acc, g, t)
            _copy_partial(out, tmp, t, g)


@njit(cache=True, nogil=True, inline="always")
def _q8_blocks_avx2(o, o0, qa, sa, blk, g, t):
    # o[o0 : o0 + G] (flat, zeroed) += all blocks of group g for activation row t
    for b in range(blk.shape[1]):
        avx2_q8.blk_q8(o, o0, blk, g * blk.strides[0] + b * blk.strides[1], qa, t * qa.strides[0] + b * QK, sa[t, b])


@njit(cache=True, nogil=True)
def q8_group_avx2(out, qa, sa, blk, acc, g):
    """q8_group with the AVX2 block kernel (avx2_q8.blk_q8); same int32 sums and float order."""
    for t in range(out.shape[0]):
        if (g + 1) * G <= out.shape[1]:
            for r in range(G):
                out[t, g * G + r] = F32(0.0)
            _q8_blocks_avx2(out, (t * out.strides[0]) // 4 + g * G, qa, sa, blk, g, t)
        else:  # last group of a padded weight
            tmp = np.zeros(G, np.float32)
            _q8_blocks_avx2(tmp, 0, qa, sa, blk, g, t)
            _copy_partial(out, tmp, t, g)


@njit(cache=True, nogil=True, inline="always")
def _q8(out, qa, sa, blk, acc, g):
    # one group of a Q8_0 matrix for rows T < BATCHED_MIN_T; a decode row's full group in the caller's code
    # (see _q4: a call cost its arguments' reference counts)
    if HAVE_AVX2 and out.shape[0] == 1 and (g + 1) * G <= out.shape[1]:
        for r in range(G):
            out[0, g * G + r] = F32(0.0)
        _q8_blocks_avx2(out, g * G, qa, sa, blk, g, 0)
    else:
        q8_group(out, qa, sa, blk, acc, g)


@njit(cache=True, nogil=True, inline="always")
def _q8_rows_call(left):
    # rows of the next grp_q8_rows call with `left` rows to go: 8 where the target takes 8 (avx2_q8.ROWS_MAX_Q8)
    return 8 if left >= 8 and avx2_q8.ROWS_MAX_Q8 >= 8 else min(avx2.ROWS_MAX, left)


@njit(cache=True, nogil=True, inline="always")
def _grp_q8_rows(o, o0, o_st, qa, sa, xs, blk, g, t, n):
    # rows t .. t + n - 1 (n <= avx2.ROWS_MAX, or 8) of o (flat offsets o0 + i o_st) <- all Q8_0 blocks of group g
    a0, ast = t * qa.strides[0], qa.strides[0]
    s0, sst = t * (sa.strides[0] // 4), sa.strides[0] // 4
    x0, xst = t * (xs.strides[0] // 4), xs.strides[0] // 4
    bo, nb = g * blk.strides[0], blk.shape[1]
    if n == 8:
        avx2_q8.grp_q8_rows8(o, o0, o_st, blk, bo, qa, a0, ast, sa, xs, s0, sst, x0, xst, nb)
    elif n == 4:
        avx2_q8.grp_q8_rows4(o, o0, o_st, blk, bo, qa, a0, ast, sa, xs, s0, sst, x0, xst, nb)
    elif n == 3:
        avx2_q8.grp_q8_rows3(o, o0, o_st, blk, bo, qa, a0, ast, sa, xs, s0, sst, x0, xst, nb)
    elif n == 2:
        avx2_q8.grp_q8_rows2(o, o0, o_st, blk, bo, qa, a0, ast, sa, xs, s0, sst, x0, xst, nb)
    else:
        avx2_q8.grp_q8_rows1(o, o0, o_st, blk, bo, qa, a0, ast, sa, xs, s0, sst, x0, xst, nb)


@njit(cache=True, nogil=True)
def q8_group_batched(out, qa, sa, xs, blk, g):
    """As q8_group for T > 1 (a verify pass's logits). Up to ROWS_UNPACKED_Q8 rows: avx2_q8.grp_q8_rows on
    ROWS_MAX rows at a time (each block sign-extended once in registers for them, or where the target has
    AVX512-VNNI its bytes flipped and interleaved for vpdpbusd, with xs's block sums: any T); more: each block is
    sign-extended once into a 2 KiB L1 buffer (avx2_q8.unpack_q8) and every row does the pair multiply-adds
    (vpmaddwd) on it. Same int32 block sums and float order as q8_group, so each row equals a one-row call
    bit for bit. AVX2 only."""
    t_n = out.shape[0]
    if t_n <= ROWS_UNPACKED_Q8:
        if (g + 1) * G <= out.shape[1]:
            t = 0
            while t < t_n:
                n = _q8_rows_call(t_n - t)
                _grp_q8_rows(out, (t * out.strides[0]) // 4 + g * G, out.strides[0] // 4, qa, sa, xs, blk, g, t, n)
                t += n
        else:  # last group of a padded weight
            part = np.zeros((t_n, G), np.float32)
            t = 0
            while t < t_n:
                n = _q8_rows_call(t_n - t)
                _grp_q8_rows(part, t * G, G, qa, sa, xs, blk, g, t, n)
                t += n
            for t in range(t_n):
                _copy_partial(out, part[t], t, g)
        return
    full, part = _batched_target(out, g)
    buf = np.empty(avx2_q8.UNBUF8, np.uint8)
    for b in range(blk.shape[1]):
        avx2_q8.unpack_q8(buf, blk, g * blk.strides[0] + b * blk.strides[1])
        for t in range(t_n):
            if full:
                avx2_q8.blk_q8u(out, (t * out.strides[0]) // 4 + g * G, buf, qa, t * qa.strides[0] + b * QK, sa[t, b])
            else:
                avx2_q8.blk_q8u(part, t * G, buf, qa, t * qa.strides[0] + b * QK, sa[t, b])
    if not full:
        for t in range(t_n):
            _copy_partial(out, part[t], t, g)


@njit(cache=True, nogil=True)
def q8_group_batched_generic(out, qa, sa, xs, blk, g):
    """q8_group_batched without AVX2: row by row (q8_group)."""
    q8_group(out, qa, sa, blk, np.empty(G, np.int32), g)


if HAVE_AVX2:
    q8_group_generic, q8_group = q8_group, q8_group_avx2
else:
    q8_group_batched = q8_group_batched_generic


@njit(cache=True, nogil=True, parallel=True)
def mm_q8(out, qa, sa, blk, acc32):
    """out (T, rows) f32 <- x @ W^T for interleaved Q8_0 W; x as qa (T, n) int8 + sa (T, nb), row by row
    (the decode form; any T, but mm_q8_batched is faster from BATCHED_MIN_T rows and gives the same bits).
    Products of two int8 fit int16; pairs of them still do (<= 2 * 127 * 127), the sum goes to int32.
    Two kernels rather than a branch: a cold start compiles only this one before the first token (the
    head of the kernel-by-kernel step, rows_out = 1): 6.4 -> 3.4 s of compiling, measured."""
    for g in prange(blk.shape[0]):
        q8_group(out, qa, sa, blk, acc32[g], np.int64(g))


@njit(cache=True, nogil=True)
def mm_q8_part(lo, hi, out, qa, sa, blk, acc32):
    """Row groups lo..hi of mm_q8 on the calling thread (see mm_q4x3_part)."""
    for g in range(lo, hi):
        q8_group(out, qa, sa, blk, acc32[g], g)


@njit(cache=True, nogil=True, parallel=True)
def mm_q8_batched(out, qa, sa, xs, blk):
    """mm_q8 for T >= BATCHED_MIN_T rows: each block sign-extended once for all rows (q8_group_batched)."""
    for g in prange(blk.shape[0]):
        q8_group_batched(out, qa, sa, xs, blk, np.int64(g))


def matmul(out, x, w, scratch):
    """out (T, d) f32 <- x (T, n) f32 @ W (d, n)^T. One pass over W serves all T rows."""
    if not isinstance(w, (FastWeight, kquant.KWeight)):
        cpu.matmul(out, x, w, scratch.cpu)
        return
    t_n, n = x.shape
    qa, sa, xs = scratch.qa[:t_n, :n], scratch.sa[:t_n, :n // QK], scratch.xs[:t_n, :XS * (n // QK)]
    quantize_rows(qa, sa, xs, x)
    if isinstance(w, kquant.KWeight):
        kquant.matmul(out, qa, sa, xs, w)
    elif w.kind == "q4k":
        q4k.matmul(out, qa, sa, xs, w.blocks)
    elif w.kind == "q4":
        (mm_q4_parts if w.blocks.ndim == 4 else mm_q4)(out, qa, sa, xs, w.blocks, w.acc16)
    elif t_n >= BATCHED_MIN_T:
        mm_q8_batched(out, qa, sa, xs, w.blocks)
    else:
        mm_q8(out, qa, sa, w.blocks, w.acc32)


@njit(cache=True, nogil=True, fastmath={"nnan", "ninf", "nsz", "contract", "afn", "reassoc"}, error_model="numpy")
def swiglu(out, gate, up):
    """out (T, f) <- silu(gate) * up with the vectorizable exp (attn.exp_fast, ~2 ulp): the fused step's form
    (step.swiglu_fast is this function), so the plain walk computes the same bits; with kernels.py's np.exp
    the two differed in about half the values by an ulp, which the int8 quantization of the result hid in
    most rows but not all (SmolLM2's prompts). error_model="numpy": numba's default division checks for
    zero (Python's ZeroDivisionError), a branch that kept this loop scalar (vdivss); fastmath without "arcp"
    keeps the division exact (no reciprocal estimate); 4x faster than the np.exp form (6.1 -> 1.5 us for
    1536 values, measured)."""
    for t in range(out.shape[0]):
        for i in range(out.shape[1]):
            g = gate[t, i]
            out[t, i] = g / (F32(1.0) + exp_fast(-g)) * up[t, i]


# ------------------------------------------------------------------------------------------------ embed
@njit(cache=True, nogil=True)
def embed_q4(out, blk, tokens):
    """out (T, n) <- rows tokens (T,) of an interleaved 4-bit table: d * q + m, llama.cpp's dequantization."""
    for t in range(tokens.shape[0]):
        g, rg = tokens[t] // G, tokens[t] % G
        h, r8, shift = rg // 16, rg % 8, 4 * ((rg % 16) // 8)
        for b in range(blk.shape[1]):
            dv, mv = h2f(_bits(blk, g, b, D_OFF + 2 * rg)), h2f(_bits(blk, g, b, M_OFF + 2 * rg))
            for j in range(QK):
                q = (I32(_nib(blk, g, b, 2 * (j // 4) + h, 4 * r8 + j % 4)) >> shift) & 15
                out[t, b * QK + j] = dv * F32(q) + mv


@njit(cache=True, nogil=True)
def embed_q8(out, blk, tokens):
    """out (T, n) <- rows tokens (T,) of an interleaved Q8_0 table."""
    for t in range(tokens.shape[0]):
        g, r = tokens[t] // G, tokens[t] % G
        for b in range(blk.shape[1]):
            dv = h2f(_bits(blk, g, b, D8_OFF + 2 * r))
            for j in range(QK):
                out[t, b * QK + j] = dv * F32(_val8(blk, g, b, j // 2, 2 * r + j % 2))


def embed(out, w, tokens):
    """out (T, n) f32 <- rows tokens (T,) int32 of the embedding table W (vocab, n)."""
    if isinstance(w, kquant.KWeight):
        kquant.embed(out, w, tokens)
    elif not isinstance(w, FastWeight):
        cpu.embed(out, w, tokens)
    elif w.kind == "q4":
        embed_q4(out, w.blocks, tokens)
    elif w.kind == "q4k":
        q4k.embed(out, w.blocks, tokens)
    else:
        embed_q8(out, w.blocks, tokens)


def _split_scratch(q, k_cache):
    """(scores, part) scratch of the split attention kernels for q (T, H, hd) over k_cache (cap, n_kv,
    hd); made per call: tensor-parallel shards may run concurrently, so nothing is shared."""
    from .attn import SPLITS, chunk_cap
    t_n, n_head, hd = q.shape
    cap, n_kv = k_cache.shape[:2]
    nt = numba.config.NUMBA_NUM_THREADS
    return (np.zeros((nt, n_head, chunk_cap(cap)), np.float32),
            np.zeros((t_n, n_kv, SPLITS, n_head // n_kv, hd + 2), np.float32))


def attention_f16(out, q, k_cache, v_cache, pos0, scale):
    """ref.attention_f16's contract, computed by the fused step's split kernel (attn), so every path of
    the cpu backend (fused step, per-kernel forward, tensor-parallel shards) gets bit-identical attention."""
    from .attn import attention_f16_split
    attention_f16_split(out, q, k_cache.view(np.uint16), v_cache.view(np.uint16), pos0, F32(scale),
                        *_split_scratch(q, k_cache))


def attention_int8(out, q, k_q, k_s, v_q, v_s, pos0, scale):
    """ref.attention_int8's contract through the fused step's split kernel (see attention_f16)."""
    from .attn_int8 import attention_int8_split
    attention_int8_split(out, q, k_q, k_s, v_q, v_s, pos0, F32(scale), *_split_scratch(q, k_q))


from . import q4k  # noqa: E402  (the 'q4k' kernels import this module's helpers)
