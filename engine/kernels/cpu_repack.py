"""File blocks -> cpu_fast's row-interleaved layout (see cpu_fast.FastWeight), in one jitted pass per weight.

Why jitted: the numpy version (strided f16 gathers, then 4-D transposes of uint8 arrays, which numpy copies
element by element) took ~0.55 s of every start for SmolLM2's 211 matrices and made several temporaries per
weight; this reads each file block once and writes each output byte once (~0.06 s, measured). A disk cache
of repacked weights was not chosen: it would double the model on disk and need its own invalidation, and the
fused step copies the weights into per-role stacks anyway, so mapping a cache would not save that RSS.
Output is bit-identical to the numpy version (tests/engine/test_repack.py keeps it as the reference).
Half floats are converted through a 65536-entry table built by numpy, so they convert exactly as numpy's
astype does (subnormals, infinities, NaN payloads).
"""
from __future__ import annotations

from .. import numba_env  # noqa: F401  (must precede the numba import: SLP flag, cache dir, threading layer)

import numpy as np
from numba import njit

from ..quant import QK
from .cpu_fast import G  # rows per interleaved group

# f16 bit pattern -> f32 (256 KiB, stays in L2 while a weight is repacked)
F16_TO_F32 = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


@njit(cache=True, nogil=True)
def _half(f16, raw, r, i):
    return f16[np.int64(raw[r, i]) | (np.int64(raw[r, i + 1]) << 8)]


@njit(cache=True, nogil=True)
def repack_q4_into(qs, d, m8, raw, qs_off, has_min, f16):
    """raw (rows, nb * B) uint8 Q4_0 (B=18, qs_off=2) or Q4_1 (B=20, qs_off=4) blocks ->
    qs (ng, nb, 16, G) uint8, d (ng, nb, G) f32, m8 (ng, nb, G) f32 = m + 8 d (Q4_1 only: has_min).
    Padding rows (rows..ng*G-1) are left as the caller allocated them (zeros)."""
    rows = raw.shape[0]
    nb = d.shape[1]
    bb = qs_off + 16  # bytes per block
    eight = np.float32(8.0)
    for r in range(rows):
        g, rr = r // G, r % G
        for b in range(nb):
            base = b * bb
            dv = _half(f16, raw, r, base)
            d[g, b, rr] = dv
            if has_min:
                m8[g, b, rr] = _half(f16, raw, r, base + 2) + eight * dv
            for j in range(16):
                qs[g, b, j, rr] = raw[r, base + qs_off + j]


@njit(cache=True, nogil=True)
def repack_q8_into(qs, d, raw, f16):
    """raw (rows, nb * 34) uint8 Q8_0 blocks -> qs (ng, nb, 16, 2G) uint8 (the int8 values' bytes: values
    2i, 2i+1 of row r at [.., i, 2r], [.., i, 2r+1]), d (ng, nb, G) f32. Padding rows left as allocated."""
    rows = raw.shape[0]
    nb = d.shape[1]
    for r in range(rows):
        g, rr = r // G, r % G
        for b in range(nb):
            base = b * 34
            d[g, b, rr] = _half(f16, raw, r, base)
            for i in range(16):
                qs[g, b, i, 2 * rr] = raw[r, base + 2 + 2 * i]
                qs[g, b, i, 2 * rr + 1] = raw[r, base + 3 + 2 * i]


def repack_arrays(raw: np.ndarray, kind: str, cols: int):
    """raw (rows, bytes_per_row) uint8 blocks of kind 'q4_0' | 'q4_1' | 'q8_0' ->
    (qs, d, m8): the cpu_fast.FastWeight arrays (m8 None for q8_0; qs int8 for q8_0)."""
    rows = raw.shape[0]
    nb, ng = cols // QK, (rows + G - 1) // G
    raw = np.ascontiguousarray(raw)  # a plain ndarray view of the mapping (numba does not type np.memmap)
    d = np.zeros((ng, nb, G), np.float32)
    if kind == "q8_0":
        qs = np.zeros((ng, nb, 16, 2 * G), np.uint8)
        repack_q8_into(qs, d, raw, F16_TO_F32)
        return qs.view(np.int8), d, None
    qs = np.zeros((ng, nb, 16, G), np.uint8)
    m8 = np.zeros((ng, nb, G), np.float32)
    if kind == "q4_1":
        repack_q4_into(qs, d, m8, raw, 4, True, F16_TO_F32)
    else:
        repack_q4_into(qs, d, m8, raw, 2, False, F16_TO_F32)
    return qs, d, m8
