"""The DFlash drafter's QKV tail in one call (engine/spec/dflash.DFlashNet): RoPE of its queries and keys and
the f16 store of its keys and values, on the column ranges of the one matmul that made q, k and v.

A drafting round is many small calls into numba, each ~5 us hot and ~50 us with its dispatch state out of
cache after the target's pass (probes/round_overhead.py); this one replaces three (kernels.rope twice, the
cache's f16 store). The arithmetic is theirs: kernels.rope's angle, cosine and sine in float64 per (row, pair)
and its rotation (_rotate: float64 products, one rounding to float32), attn.store_f16's conversion (f2h,
round to nearest even as numpy's cast): the same bits (tests/engine/test_dflash.py).
"""
from __future__ import annotations

from ... import numba_env  # noqa: F401  (flags before numba)

import numpy as np
from numba import njit

from .attn import f2h


@njit(cache=True, nogil=True, inline="always")
def _rope_cols(x, c0, n_h, hd, pos0, inv_freq, neox):
    """Rotate columns c0 .. c0 + n_h hd of x (T, >=) in place as heads of hd, row t at position pos0 + t."""
    half = hd // 2
    for t in range(x.shape[0]):
        for i in range(half):
            ang = np.float64(pos0 + t) * np.float64(inv_freq[i])
            c, s = np.cos(ang), np.sin(ang)
            ia, ib = (i, i + half) if neox else (2 * i, 2 * i + 1)
            for h in range(n_h):
                o = c0 + h * hd
                a, b = np.float64(x[t, o + ia]), np.float64(x[t, o + ib])
                x[t, o + ia] = a * c - b * s
                x[t, o + ib] = a * s + b * c


@njit(cache=True, nogil=True)
def rope_store(q, q_pos, kv, k16, v16, pos0, inv_freq, neox, n_kv, hd):
    """q (Tq, n_head hd) rotated in place at positions q_pos.. (Tq may be 0); kv (T, 2 n_kv hd) = [k | v]: k
    rotated at positions pos0.., then k and v stored as f16 bits into k16, v16 (cap, n_kv, hd) uint16 at
    pos0.. ."""
    if q.shape[0] > 0:
        _rope_cols(q, 0, q.shape[1] // hd, hd, q_pos, inv_freq, neox)
    _rope_cols(kv, 0, n_kv, hd, pos0, inv_freq, neox)
    kv_dim = n_kv * hd
    for t in range(kv.shape[0]):
        for h in range(n_kv):
            for j in range(hd):
                k16[pos0 + t, h, j] = f2h(kv[t, h * hd + j])
                v16[pos0 + t, h, j] = f2h(kv[t, kv_dim + h * hd + j])
