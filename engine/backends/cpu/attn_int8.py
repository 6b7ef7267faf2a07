"""Decode attention over an int8 KV cache (`--kv-dtype int8`) for the fused CPU step (numba).

Same work items, chunks, softmax and merge as attn's f16 attention (imported from there). Where the
target has AVX512-VNNI and the shape suits it (64-value blocks of 32-value groups: SmolLM2, Qwen), the scores
in integer dot products (attn_int8_vnni, the query in 16 bits) and attn_int8_avx2's V sums; else,
where the target has AVX2/FMA/F16C (attn.VECTOR_ATTN) and a scale group is a multiple of 8 values,
attn's positions-outer item with attn_int8_avx2's IR kernels; otherwise the numba loops below,
which dequantize value by value.
"""
from __future__ import annotations

from ... import numba_env  # noqa: F401  (flags before numba)

import numba
import numpy as np
from numba import njit, prange

from .attn import (SPLITS, VECTOR_ATTN, _clear_part, _item_heads_vec, _softmax_rows, _work_item, merge_parts,
                   softmax_and_sums)
from .attn_int8_vnni import VNNI512, scores_q8_vnni, usable  # noqa: F401  (VNNI512: tests)

F32 = np.float32


@njit(cache=True, nogil=True, fastmath=True, inline="always")
def _scores_q8_loops(s, qg, kq, ks, kh, lo, hi, scale):
    """s[g, p - lo] <- scale * qg[g] . dequant(K[p, kh]) for lo <= p < hi; per scale group a partial dot."""
    group, hd = qg.shape
    n_g = ks.shape[2]
    gs = hd // n_g
    for g in range(group):  # head outer: its q row stays in registers over the positions
        qv = qg[g]
        for p in range(lo, hi):
            a = F32(0.0)
            for gi in range(n_g):
                part = F32(0.0)
                for j in range(gs):
                    part += qv[gi * gs + j] * F32(kq[p, kh, gi * gs + j])
                a += part * ks[p, kh, gi]
            s[g, p - lo] = a * scale


@njit(cache=True, nogil=True, fastmath=True, inline="always")
def _weighted_sum_q8_loops(acc, s, vq, vs, kh, lo, hi):
    """acc[g, :hd] += sum over lo <= p < hi of s[g, p - lo] * dequant(V[p, kh])."""
    group = s.shape[0]
    n_g = vs.shape[2]
    gs = vq.shape[2] // n_g
    for g in range(group):
        ag = acc[g]
        for p in range(lo, hi):
            w = s[g, p - lo]
            for gi in range(n_g):
                ws = w * vs[p, kh, gi]
                for j in range(gs):
                    ag[gi * gs + j] += ws * F32(vq[p, kh, gi * gs + j])


@njit(cache=True, nogil=True, fastmath=True, inline="always")
def _item_heads_q8_loops(part, sc, qt, kv, t, c, lo, hi, scale):
    """Positions lo:hi of every head of row t (qt (H, hd)) into part[t, :, c] over an int8 cache kv = (kq,
    ks, vq, vs), one KV head after the other, with the numba loops. sc (H, >= hi - lo) f32 scores."""
    kq, ks, vq, vs = kv
    n_kv = kq.shape[1]
    group = qt.shape[0] // n_kv
    for kh in range(n_kv):
        pc, sg = part[t, kh, c], sc[kh * group:(kh + 1) * group]
        _scores_q8_loops(sg, qt[kh * group:(kh + 1) * group], kq, ks, kh, lo, hi, scale)
        _softmax_rows(pc, sg, hi - lo)
        _weighted_sum_q8_loops(pc, sg, vq, vs, kh, lo, hi)


@njit(cache=True, nogil=True, fastmath=True, inline="always")
def _item_heads_q8_vec(part, sc, qt, kv, t, c, lo, hi, scale):
    """_item_heads_q8_loops' contract through attn._item_heads_vec (the IR kernels, positions outer);
    the loops where a scale group is not a multiple of 8 values."""
    if (kv[0].shape[2] // kv[1].shape[2]) % 8 != 0:
        _item_heads_q8_loops(part, sc, qt, kv, t, c, lo, hi, scale)
    else:
        _item_heads_vec(part, sc, qt, kv, t, c, lo, hi, scale)


@njit(cache=True, nogil=True, fastmath=True, inline="always")
def _item_heads_q8_vnni(part, sc, qt, kv, t, c, lo, hi, scale):
    """_item_heads_q8_vec's contract with the scores in integer dot products (attn_int8_vnni: the query
    in 16 bits per value as two int8 parts, ref.attention_int8_q16), then the same softmax and V sums; the
    other kernels where the shape is not one it serves."""
    kq, ks, vq, vs = kv
    n_head, hd = qt.shape
    n_kv = kq.shape[1]
    if not usable(n_head, n_kv, hd, ks.shape[2]):
        _item_heads_q8_vec(part, sc, qt, kv, t, c, lo, hi, scale)
        return
    scores_q8_vnni(sc, qt, kq, ks, lo, hi - lo, scale)
    softmax_and_sums(part, sc, kv, t, c, lo, hi, n_head, n_head // n_kv)


_item_heads_q8 = (_item_heads_q8_vnni if VNNI512 else _item_heads_q8_vec) if VECTOR_ATTN else _item_heads_q8_loops


@njit(cache=True, nogil=True, fastmath=True)
def attn_item_int8(part, sc, q, kq, ks, vq, vs, it, pos0, scale):
    """attn.attn_item_f16 over an int8 cache (kq, vq int8; ks, vs f32 group scales): work item it (row t,
    chunk c) into part[t, kh, c] for every KV head kh."""
    t, c, lo, hi = _work_item(it, pos0)
    for kh in range(kq.shape[1]):
        _clear_part(part[t, kh, c])
    if lo < hi:
        _item_heads_q8(part, sc, q[t], (kq, ks, vq, vs), t, c, lo, hi, scale)


@njit(cache=True, nogil=True, parallel=True, fastmath=True)
def attention_int8_split(out, q, kq, ks, vq, vs, pos0, scale, sbuf, part):
    """As attn.attention_f16_split over an int8 cache: kq, vq (cap, n_kv, hd) int8, ks, vs (cap, n_kv,
    hd // g) f32 scales, one per g values (ref.quantize_kv_int8). Same chunks, scratch and merge: no
    allocation."""
    t_n = q.shape[0]
    for it in prange(t_n * SPLITS):
        attn_item_int8(part, sbuf[numba.get_thread_id()], q, kq, ks, vq, vs, np.int64(it), pos0, scale)
    merge_parts(out, part[:t_n])
