"""The interleaved weight layout the cpu backend's matmuls read (fast.py) and repack.py writes.

Rows are interleaved in groups of G = 32: a group's block b holds one 32-value block of all G rows, its
values first (the 4-bit nibbles in avx2.py's byte order, or the Q8_0 value pairs), then the rows' f16 scales
(and mins for 4-bit). fast.py's docstring says why; this module only says where each byte is.
"""
from __future__ import annotations

from ... import numba_env  # noqa: F401  (must precede the numba import: SLP flag, cache dir, threading layer)

import numpy as np
from numba import njit

from . import avx2

G = 32  # rows per interleaved group (compile-time constant of the kernels)
D_OFF, M_OFF = avx2.D_OFF, avx2.M_OFF  # a 4-bit block's scales and mins, after its nibbles
D8_OFF = avx2.D8_OFF  # a Q8_0 block's scales, after its values


def parts(blocks: np.ndarray, kind: str) -> tuple:
    """(qs, d, m): views of a layout's values (..., 16, G) uint8 ('q4') or (..., 16, 2G) int8 ('q8'), its f16
    scale bits and min bits (..., ng, nb, G) uint16 (m None for 'q8'), in place."""
    if kind == "q8":
        return (blocks[..., :D8_OFF].reshape(blocks.shape[:-1] + (16, 2 * G)),
                blocks[..., D8_OFF:avx2.BLK8].view(np.uint16), None)
    return (blocks[..., :D_OFF].reshape(blocks.shape[:-1] + (16, G)), blocks[..., D_OFF:M_OFF].view(np.uint16),
            blocks[..., M_OFF:avx2.BLK4].view(np.uint16))


@njit(cache=True, nogil=True, inline="always")
def nib_at(v, i):
    """A block's byte offset of byte i of its nibble vector v (< 16) in the 4-bit layout (avx2's
    docstring): where repack writes it and the generic kernels read it."""
    return 32 * v + i


@njit(cache=True, nogil=True, inline="always")
def val8_at(jp, i):
    """A block's byte offset of byte i (2r + value parity) of its pair vector jp (< 16) in the Q8_0 layout."""
    return 64 * jp + i
