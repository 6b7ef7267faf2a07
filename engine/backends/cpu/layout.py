"""The interleaved weight layout the cpu backend's matmuls read (fast.py) and repack.py writes.

Rows are interleaved in groups of G = 32: a group's block b holds one 32-value block of all G rows, its
values first (the 4-bit nibbles in avx2.py's byte order, or the Q8_0 value pairs), then the rows' f16 scales
(and mins for 4-bit). fast.py's docstring says why; this module only says where each byte is.

Q4_K ('q4k') keeps the file's 6-bit scales: a group's blocks come in super-blocks of 8 (256 values, SB4K =
4736 bytes): the 32 rows' f16 d (bytes 0-63) and f16 dmin (64-127), then 8 blocks of K_BLK = 576 bytes, each
the 4-bit block's 512 bytes of nibbles, the rows' u8 scales (K_SC) and u8 mins (K_MN). A block's scale and
min are f16(d sc) and f16(-(dmin mn)), formed in the kernels: the values of the 'q4' layout that Q4_K took
as Q4_1 blocks before (640 bytes a block), on 7.5% fewer bytes (592 a block: the file's 576 + the header).
"""
from __future__ import annotations

from ... import numba_env  # noqa: F401  (must precede the numba import: SLP flag, cache dir, threading layer)

import numpy as np
from numba import njit

from . import avx2

G = 32  # rows per interleaved group (compile-time constant of the kernels)
D_OFF, M_OFF = avx2.D_OFF, avx2.M_OFF  # a 4-bit block's scales and mins, after its nibbles
D8_OFF = avx2.D8_OFF  # a Q8_0 block's scales, after its values
SB4K, K_HDR, K_BLK, K_SC, K_MN = avx2.SB4K, avx2.K_HDR, avx2.K_BLK, avx2.K_SC, avx2.K_MN  # the 'q4k' layout


def parts(blocks: np.ndarray, kind: str) -> tuple:
    """(qs, d, m): views of a layout's values (..., 16, G) uint8 ('q4') or (..., 16, 2G) int8 ('q8'), its f16
    scale bits and min bits (..., ng, nb, G) uint16 (m None for 'q8'), in place; for 'q4k' (None, the
    super-blocks' f16 d bits, their dmin bits) (..., ng, nsb, G) uint16."""
    if kind == "q4k":
        hdr = blocks[..., :K_HDR].view(np.uint16)
        return None, hdr[..., :G], hdr[..., G:]
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


@njit(cache=True, nogil=True)
def f2h(x):
    """float32 -> the f16 bits nearest (ties to even), subnormals included (as vcvtps2ph and numpy's
    astype(float16)); beyond f16's range inf, NaN a quiet NaN. The generic kernels' f16(d sc) ('q4k')."""
    u = np.float32(x).view(np.uint32)
    sign = np.uint16((u >> np.uint32(16)) & np.uint32(0x8000))
    a = u & np.uint32(0x7FFFFFFF)
    if a > np.uint32(0x7F800000):
        return np.uint16(sign | np.uint16(0x7E00))
    if a >= np.uint32(0x477FF000):  # >= 65520: rounds to inf
        return np.uint16(sign | np.uint16(0x7C00))
    if a >= np.uint32(0x38800000):  # a normal f16: round the mantissa to 10 bits, rebias the exponent
        r = (a + np.uint32(0x0FFF) + ((a >> np.uint32(13)) & np.uint32(1))) >> np.uint32(13)
        return np.uint16(sign | np.uint16(r - np.uint32(112 << 10)))
    m = np.float32(np.uint32(a).view(np.float32) * np.float32(16777216.0))  # in units of 2^-24, exact
    m = np.float32(np.float32(m + np.float32(8388608.0)) - np.float32(8388608.0))  # rint, ties to even
    return np.uint16(sign | np.uint16(np.uint32(m)))
