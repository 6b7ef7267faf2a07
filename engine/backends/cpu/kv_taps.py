"""The DFlash drafter's KV taps out of an f16 cache in one jitted call (engine/spec/dflash_taps.kv_rows).

The numpy form (dflash_taps: `_layer_kv` then `unrope`, per tapped layer) builds its cos / sin and a dozen
temporaries per layer: ~0.19 ms a round for two positions of three layers on the 2-core dev VM, as much as a
draft layer's Q/K/V matmuls. Here one call per layer does the same float64 operations on the same values,
reading the f16 bits directly (the conversion is exact either way), with cos and sin from a table of positions
computed by numpy as the numpy form computes them (`rope_table`): the same features bit for bit
(tests/engine/test_dflash.py compares the two).
"""
from __future__ import annotations

from ... import numba_env  # noqa: F401  (before numba: SLP vectorizer on, workqueue threads, flag-keyed cache)

import numpy as np
from numba import njit

from .attn import h2f


def rope_table(n_pos: int, inv_freq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin) (n_pos, hd / 2) float64 of the angles p * inv_freq for positions 0..n_pos-1, as
    dflash_taps.unrope computes them for its rows (float64 position times float64 frequency)."""
    ang = np.arange(0, n_pos, dtype=np.float64)[:, None] * np.asarray(inv_freq, np.float64)[None, :]
    return np.cos(ang), np.sin(ang)


@njit(cache=True, nogil=True)
def kv_taps_f16(out, col, k16, v16, lo, cos, sin, neox):
    """out[t, col : col + kv_dim] <- K row lo + t rotated back by its position's RoPE, out[t, col + kv_dim :
    col + 2 kv_dim] <- V row lo + t, for t < out.shape[0]. k16, v16 (cap, n_kv, hd) uint16 f16 bits; out (T,
    width) f32; cos, sin (>= lo + T, hd / 2) f64 (rope_table). neox: halves rotate together, else pairs."""
    n_kv, hd = k16.shape[1], k16.shape[2]
    half, kv = hd // 2, n_kv * hd
    for t in range(out.shape[0]):
        p = lo + t
        for h in range(n_kv):
            o = col + h * hd
            for i in range(half):
                ia, ib = (i, half + i) if neox else (2 * i, 2 * i + 1)
                a, b = np.float64(h2f(k16[p, h, ia])), np.float64(h2f(k16[p, h, ib]))
                c, s = cos[p, i], sin[p, i]
                out[t, o + ia] = np.float32(a * c + b * s)  # two roundings then one, as numpy's a*cos + b*sin
                out[t, o + ib] = np.float32(b * c - a * s)
            for j in range(hd):
                out[t, o + kv + j] = h2f(v16[p, h, j])
