"""File blocks -> fast's row-interleaved layout (see fast.FastWeight), in one jitted pass per weight.

Why jitted: the numpy version (strided f16 gathers, then 4-D transposes of uint8 arrays, which numpy copies
element by element) took ~0.55 s of every start for SmolLM2's 211 matrices and made several temporaries per
weight; this reads each file block once and writes each output byte once (~0.06 s, measured; the layer
matrices go straight into their parts of the layers' buffer, fast.prepare_layers). A warm start does
not even do that: it reads what the first start repacked back from backends/cpu/weight_store.py (checked against
`layout`).
Output is bit-identical to the numpy version (tests/engine/test_repack.py keeps it as the reference).
Scales and mins stay f16 bit patterns, copied as they are (the kernels convert them with vcvtph2ps), right
after their block's values (avx2: one stream of weights per thread).
"""
from __future__ import annotations

from ... import numba_env  # noqa: F401  (must precede the numba import: SLP flag, cache dir, threading layer)

from concurrent.futures import ThreadPoolExecutor

import numpy as np
from numba import njit

from ...quant import QK
from .avx2 import BLK4, BLK8, D8_OFF, D_OFF, M_OFF
from .layout import G, K_BLK, K_HDR, K_MN, K_SC, SB4K, nib_at, parts, val8_at  # a layout's sizes, offsets, views


@njit(cache=True, nogil=True)
def repack_q4_into(blk, raw, qs_off, has_min):
    """raw (rows, nb * B) uint8 Q4_0 (B=18, qs_off=2) or Q4_1 (B=20, qs_off=4) blocks -> blk (ng, nb, BLK4)
    uint8: each block's nibbles in avx2's byte order, then its rows' f16 scales (D_OFF) and mins (M_OFF:
    Q4_1 only, has_min), the file's bits. Padding rows (rows..ng*G-1) get zero nibbles; their scales and mins
    stay as allocated."""
    rows = raw.shape[0]
    ng, nb = blk.shape[0], blk.shape[1]
    bb = qs_off + 16  # bytes per block
    for r in range(rows):
        g, rr = r // G, r % G
        for b in range(nb):
            for k in range(2):  # the f16 bytes as they are
                blk[g, b, D_OFF + 2 * rr + k] = raw[r, b * bb + k]
                if has_min:
                    blk[g, b, M_OFF + 2 * rr + k] = raw[r, b * bb + 2 + k]
    # rows R0 = 16h + r8 and R1 = R0 + 8 of a group share their bytes: value v of R0 in the low nibble, of R1
    # in the high one, at vector 2 (v // 4) + h, byte 4 r8 + v % 4; file byte j holds values j and j + 16
    for g in range(ng):
        for h in range(2):
            for r8 in range(8):
                r0 = g * G + 16 * h + r8
                r1 = r0 + 8
                for b in range(nb):
                    base = b * bb + qs_off
                    for j in range(16):
                        x0 = raw[r0, base + j] if r0 < rows else np.uint8(0)
                        x1 = raw[r1, base + j] if r1 < rows else np.uint8(0)
                        v, i = 2 * (j // 4) + h, 4 * r8 + j % 4  # the high nibbles: values 16.., vector v + 8
                        lo4 = np.uint8((x0 & np.uint8(15)) | np.uint8((x1 & np.uint8(15)) << np.uint8(4)))
                        blk[g, b, nib_at(v, i)] = lo4
                        blk[g, b, nib_at(v + 8, i)] = np.uint8((x0 >> np.uint8(4)) | (x1 & np.uint8(0xF0)))


@njit(cache=True, nogil=True)
def repack_q8_into(blk, raw):
    """raw (rows, nb * 34) uint8 Q8_0 blocks -> blk (ng, nb, BLK8) uint8 bytes of the int8 layout (values 2i,
    2i+1 of row r at bytes 64 i + 2r, 64 i + 2r + 1), then the rows' f16 scale bits (D8_OFF). Padding rows
    left as allocated."""
    rows = raw.shape[0]
    nb = blk.shape[1]
    for r in range(rows):
        g, rr = r // G, r % G
        for b in range(nb):
            base = b * 34
            for k in range(2):
                blk[g, b, D8_OFF + 2 * rr + k] = raw[r, base + k]
            for i in range(16):
                blk[g, b, val8_at(i, 2 * rr)] = raw[r, base + 2 + 2 * i]
                blk[g, b, val8_at(i, 2 * rr + 1)] = raw[r, base + 3 + 2 * i]


@njit(cache=True, nogil=True)
def repack_q4k_into(blk, raw, sc, mn):
    """raw (rows, nsb * 144) uint8 Q4_K blocks, sc / mn (rows, nsb * 8) uint8 their sub-blocks' 6-bit scales and
    mins -> blk (ng, nsb, SB4K) uint8, the 'q4k' layout (layout.py): per super-block the rows' f16 d and dmin
    (the file's bits), then per block its nibbles in avx2's byte order and the rows' scales and mins. blk
    zeroed: padding rows keep zero nibbles, scales and header."""
    rows = raw.shape[0]
    for r in range(rows):
        g, rr = r // G, r % G
        h, n, r8 = rr // 16, (rr % 16) // 8, rr % 8
        for s in range(blk.shape[1]):
            base = s * 144
            for k in range(2):
                blk[g, s, 2 * rr + k] = raw[r, base + k]
                blk[g, s, 2 * (G + rr) + k] = raw[r, base + 2 + k]
            for j in range(8):
                at = K_HDR + j * K_BLK
                blk[g, s, at + K_SC + rr] = sc[r, 8 * s + j]
                blk[g, s, at + K_MN + rr] = mn[r, 8 * s + j]
                # sub-block j: the low nibbles (j even) or high ones of the file's chunk j // 2 (32 bytes)
                src, sh = base + 16 + 32 * (j // 2), np.uint8(4 * (j % 2))
                for v in range(QK):
                    q = np.uint8((raw[r, src + v] >> sh) & np.uint8(15))
                    p = at + nib_at(2 * (v // 4) + h, 4 * r8 + v % 4)
                    blk[g, s, p] = np.uint8(blk[g, s, p] | np.uint8(q << np.uint8(4 * n)))


def layout(kind: str, lead: tuple, rows: int, cols: int) -> list:
    """[(dtype, shape)] of a fast.FastWeight's arrays (its blocks), kind 'q8', 'q4' or 'q4k', for a (rows, cols)
    matrix; lead: () for one weight, (L,) for L stacked."""
    nb, ng = cols // QK, (rows + G - 1) // G
    if kind == "q8":
        return [(np.int8, lead + (ng, nb, BLK8))]
    if kind == "q4k":
        return [(np.uint8, lead + (ng, nb // 8, SB4K))]
    return [(np.uint8, lead + (ng, nb, BLK4))]


def repack_arrays(raw: np.ndarray, kind: str, cols: int):
    """raw (rows, bytes_per_row) uint8 blocks of kind 'q4_0' | 'q4_1' | 'q8_0' -> the fast.FastWeight
    arrays, (blocks,); None for a Q4_0 weight whose min -8 d does not fit f16 (|d| > 8188: never seen in a
    real file; the caller keeps cpu.py's layout)."""
    rows = raw.shape[0]
    ng = (rows + G - 1) // G
    if kind == "q4_k":
        blocks = np.zeros(layout("q4k", (), rows, cols)[0][1], np.uint8)
        return (blocks,) if repack_q4k(raw, blocks) else None
    arrays = [np.zeros(shape, dt) for dt, shape in layout("q8" if kind == "q8_0" else "q4", (), rows, cols)]
    if kind == "q8_0":
        blk = arrays[0].view(np.uint8)
        raw = np.ascontiguousarray(raw)
        # two halves of the groups at once (the jitted pass releases the GIL): the token embedding, the
        # largest matrix (SmolLM2: 30 MB), took ~75 ms on one thread of every start
        half = (ng + 1) // 2
        with ThreadPoolExecutor(max_workers=2) as pool:
            list(pool.map(lambda g: repack_q8_into(blk[g[0]:g[1]], raw[g[0] * G:g[1] * G]), [(0, half), (half, ng)]))
        return (arrays[0],)
    return (arrays[0],) if repack_q4(raw, kind, arrays[0]) else None


def repack_q4k(raw: np.ndarray, blocks: np.ndarray) -> bool:
    """Q4_K file blocks raw (rows, bytes_per_row) into zeroed 'q4k' blocks (ng, nsb, SB4K) (or one part of a
    layer matrix's), CHUNK rows at a time; False where a scale or min, rounded to f16, does not fit (the caller
    keeps kernels.py's layout, as it did for the Q4_1 blocks)."""
    from .kquant import q4k_scale_bytes
    raw = np.ascontiguousarray(raw)
    for r0 in range(0, raw.shape[0], CHUNK):
        part = raw[r0:r0 + CHUNK]
        got = q4k_scale_bytes(part)
        if got is None:
            return False
        repack_q4k_into(blocks[r0 // G:], part, *got)
    return True


CHUNK = 64 * G  # rows whose scales are decoded at a time (bounds the temporaries of a large matrix)


def repack_q4(raw: np.ndarray, kind: str, blocks: np.ndarray) -> bool:
    """Q4_0/Q4_1 file blocks raw (rows, bytes_per_row) into zeroed blocks (fast.FastWeight's 'q4' array,
    e.g. one part of a layer matrix: fast.prepare_layers). False for a Q4_0 weight whose min -8 d
    overflows f16."""
    raw = np.ascontiguousarray(raw)  # a plain ndarray view of the mapping (numba does not type np.memmap)
    repack_q4_into(blocks, raw, 4 if kind == "q4_1" else 2, kind == "q4_1")
    if kind == "q4_0":  # value = d (q - 8): a min of -8 d, exact in f16 (a power-of-two multiple) unless it overflows
        d, m = parts(blocks, "q4")[1:]
        dv = d.view(np.float16)
        with np.errstate(over="ignore", invalid="ignore"):
            mv = (dv * np.float16(-8.0)).astype(np.float16)
        if np.any(np.isinf(mv) & np.isfinite(dv)):
            return False
        m[...] = mv.view(np.uint16)
    return True
