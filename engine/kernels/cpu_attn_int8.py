"""Decode attention over an int8 KV cache (`--kv-dtype int8`) for the fused CPU step (numba).

Same work items, chunks, softmax and merge as cpu_attn's f16 attention (imported from there); only the
inner loops differ. Where the target has AVX2/FMA/F16C (cpu_attn.VECTOR_ATTN) and a scale group is a
multiple of 8 values (SmolLM2, Qwen: 32), they are cpu_attn_int8_avx2's IR blocks; otherwise the numba loops
below, which dequantize value by value.
"""
from __future__ import annotations

from .. import numba_env  # noqa: F401  (flags before numba)

import numba
import numpy as np
from numba import njit, prange

from .cpu_attn import SPLITS, V_BLOCK, VECTOR_ATTN, _clear_part, _softmax_rows, _work_item, merge_parts
from .cpu_attn_int8_avx2 import kdot4_q8, kdot8_q8, vsum_q8

F32 = np.float32


@njit(cache=True, nogil=True, fastmath=True, inline="always")
def _dot_q8(qv, kr, ksr):
    """qv (hd,) f32 . dequant(kr (hd,) int8, ksr (hd // gs,) f32): one position's score (the IR path's last
    positions)."""
    gs = qv.shape[0] // ksr.shape[0]
    a = F32(0.0)
    for gi in range(ksr.shape[0]):
        part = F32(0.0)
        for j in range(gi * gs, (gi + 1) * gs):
            part += qv[j] * F32(kr[j])
        a += part * ksr[gi]
    return a


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
def _item_heads_q8_loops(part, sc, qt, kq, ks, vq, vs, t, c, lo, hi, scale):
    """Positions lo:hi of every head of row t (qt (H, hd)) into part[t, :, c], one KV head after the other,
    with the numba loops. sc (H, >= hi - lo) f32 scores."""
    n_kv = kq.shape[1]
    group = qt.shape[0] // n_kv
    for kh in range(n_kv):
        pc, sg = part[t, kh, c], sc[kh * group:(kh + 1) * group]
        _scores_q8_loops(sg, qt[kh * group:(kh + 1) * group], kq, ks, kh, lo, hi, scale)
        _softmax_rows(pc, sg, hi - lo)
        _weighted_sum_q8_loops(pc, sg, vq, vs, kh, lo, hi)


@njit(cache=True, nogil=True, fastmath=True, inline="always")
def _item_heads_q8_vec(part, sc, qt, kq, ks, vq, vs, t, c, lo, hi, scale):
    """_item_heads_q8_loops' contract through cpu_attn_int8_avx2, positions outer as in
    cpu_attn._item_heads_vec; the loops where a scale group is not a multiple of 8 values."""
    if (kq.shape[2] // ks.shape[2]) % 8 != 0:
        _item_heads_q8_loops(part, sc, qt, kq, ks, vq, vs, t, c, lo, hi, scale)
        return
    n_head = qt.shape[0]
    group = n_head // kq.shape[1]
    p = lo
    while p + 8 <= hi:
        for h in range(n_head):
            kdot8_q8(sc[h], p - lo, qt[h], kq, ks, p, h // group, scale)
        p += 8
    if p + 4 <= hi:
        for h in range(n_head):
            kdot4_q8(sc[h], p - lo, qt[h], kq, ks, p, h // group, scale)
        p += 4
    while p < hi:
        for h in range(n_head):
            sc[h, p - lo] = _dot_q8(qt[h], kq[p, h // group], ks[p, h // group]) * scale
        p += 1
    for kh in range(kq.shape[1]):
        _softmax_rows(part[t, kh, c], sc[kh * group:(kh + 1) * group], hi - lo)
    for b in range(lo, hi, V_BLOCK):
        n = min(V_BLOCK, hi - b)
        for h in range(n_head):
            vsum_q8(part[t, h // group, c, h % group], sc[h], b - lo, n, vq, vs, b, h // group)


_item_heads_q8 = _item_heads_q8_vec if VECTOR_ATTN else _item_heads_q8_loops


@njit(cache=True, nogil=True, fastmath=True)
def attn_item_int8(part, sc, q, kq, ks, vq, vs, it, pos0, scale):
    """cpu_attn.attn_item_f16 over an int8 cache (kq, vq int8; ks, vs f32 group scales): work item it (row t,
    chunk c) into part[t, kh, c] for every KV head kh."""
    t, c, lo, hi = _work_item(it, pos0)
    for kh in range(kq.shape[1]):
        _clear_part(part[t, kh, c])
    if lo < hi:
        _item_heads_q8(part, sc, q[t], kq, ks, vq, vs, t, c, lo, hi, scale)


@njit(cache=True, nogil=True, parallel=True, fastmath=True)
def attention_int8_split(out, q, kq, ks, vq, vs, pos0, scale, sbuf, rowbuf, part):
    """As cpu_attn.attention_f16_split over an int8 cache: kq, vq (cap, n_kv, hd) int8, ks, vs (cap, n_kv,
    hd // g) f32 scales, one per g values (ref.quantize_kv_int8). Same chunks, scratch and merge: no
    allocation."""
    t_n = q.shape[0]
    for it in prange(t_n * SPLITS):
        attn_item_int8(part, sbuf[numba.get_thread_id()], q, kq, ks, vq, vs, it, pos0, scale)
    merge_parts(out, part[:t_n])
