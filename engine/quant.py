"""GGUF block layouts and the numpy reference dequantization (the specification of every quant kernel)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import ModelFileError
from .gguf_types import GGMLQuantizationType as QT


@dataclass
class QTensor:
    """A weight as stored in the file. shape = (rows, cols) = (out_features, in_features).

    data: uint8 (rows, bytes_per_row) raw blocks, memory-mapped (never copied); 1-D float tensors keep
    their float dtype with shape (n,).
    """

    name: str
    qtype: QT
    shape: tuple[int, ...]
    data: np.ndarray


# --------------------------------------------------------------------------------------- block layouts
QK = 32  # values per block of the "legacy" types (Q4_0, Q4_1, Q8_0)
QK_K = 256  # values per super-block of the K-quants (Q4_K, Q5_K, Q6_K)

# qtype -> (values per block, bytes per block). Layouts (little-endian, f16 = IEEE half):
#   Q8_0 (34 B):  d f16 | qs int8[32]                       x = d * q
#   Q4_0 (18 B):  d f16 | qs u8[16]  (lo nibbles: values 0..15, hi nibbles: 16..31)   x = d * (q - 8)
#   Q4_1 (20 B):  d f16 | m f16 | qs u8[16] (same nibble order)                        x = d * q + m
#   Q5_0 (22 B):  d f16 | qh u32 | qs u8[16]  value j: its nibble (as Q4_0) | bit j of qh << 4   x = d * (q - 16)
#   Q5_1 (24 B):  d f16 | m f16 | qh u32 | qs u8[16]  (q as Q5_0)                      x = d * q + m
#   Q4_K (144 B): d f16 | dmin f16 | scales u8[12] (8 x 6-bit scale + 8 x 6-bit min) | qs u8[128]
#                 sub-block j (32 values): x = d*sc[j] * q - dmin*mn[j]; 64-value chunk c holds sub-blocks
#                 2c (lo nibbles of qs[32c:32c+32]) and 2c+1 (hi nibbles)
#   Q5_K (176 B): d f16 | dmin f16 | scales u8[12] (as Q4_K) | qh u8[32] | qs u8[128] (as Q4_K's)
#                 sub-block j: x = d*sc[j] * q - dmin*mn[j], q = its nibble | (bit j of qh[l]) << 4, l < 32
#   Q6_K (210 B): ql u8[128] | qh u8[64] | scales int8[16] | d f16;  x = d * scales[j] * (q6 - 32), j per 16
SUPPORTED = {
    QT.F32: (1, 4),
    QT.F16: (1, 2),
    QT.BF16: (1, 2),
    QT.Q8_0: (QK, 34),
    QT.Q4_0: (QK, 18),
    QT.Q4_1: (QK, 20),
    QT.Q5_0: (QK, 22),
    QT.Q5_1: (QK, 24),
    QT.Q4_K: (QK_K, 144),
    QT.Q5_K: (QK_K, 176),
    QT.Q6_K: (QK_K, 210),
}


def block_info(qtype: QT, name: str = "?") -> tuple[int, int]:
    """(values per block, bytes per block) of a supported type, else ModelFileError naming the tensor."""
    if qtype not in SUPPORTED:
        supported = ", ".join(t.name for t in SUPPORTED)
        raise ModelFileError(f"tensor {name!r} uses quant type {QT(qtype).name}, not supported "
                             f"(supported: {supported}); use a GGUF quantized with one of those")
    return SUPPORTED[qtype]


def row_bytes(qtype: QT, cols: int, name: str = "?") -> int:
    """Bytes per row of `cols` values (cols must be a whole number of blocks)."""
    bs, bb = block_info(qtype, name)
    if cols % bs:
        raise ModelFileError(f"tensor {name!r}: row length {cols} is not a multiple of the {QT(qtype).name} "
                             f"block size {bs}; the file is corrupt or unsupported")
    return cols // bs * bb


def validate(qt: QTensor) -> None:
    """Check that qt.data holds exactly the bytes its shape and type need (ModelFileError otherwise)."""
    cols = qt.shape[-1]
    rows = int(np.prod(qt.shape[:-1], dtype=np.int64)) if len(qt.shape) > 1 else 1
    need = rows * row_bytes(qt.qtype, cols, qt.name)
    have = qt.data.size * qt.data.itemsize
    if have != need:
        raise ModelFileError(f"tensor {qt.name!r} ({QT(qt.qtype).name}, shape {tuple(qt.shape)}) holds "
                             f"{have} bytes, expected {need}; the model file is truncated or corrupt")


def _raw_rows(qt: QTensor) -> np.ndarray:
    """qt.data as uint8 (rows, bytes_per_row) whatever its stored dtype/shape (1-D tensors: one row)."""
    cols = qt.shape[-1]
    raw = np.ascontiguousarray(qt.data).view(np.uint8)
    return raw.reshape(-1, row_bytes(qt.qtype, cols, qt.name))


def _f16(b: np.ndarray) -> np.ndarray:
    """(..., 2) uint8 -> (...,) f32 (little-endian half floats)."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(..., 16) uint8 -> (..., 32) values 0..15: lo nibbles first, then hi nibbles."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _q5_values(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """(nb, 4) uint8 high bits (a little-endian u32: bit j for value j) and (nb, 16) nibble bytes -> (nb, 32)
    values 0..31 of Q5_0 / Q5_1 blocks."""
    bits = np.unpackbits(np.ascontiguousarray(qh), axis=-1, bitorder="little")  # (nb, 32): bit j = value j's
    return _nibbles(qs) | (bits << 4)


def _q4k_scales(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(nb, 12) uint8 -> 6-bit scales and mins, each (nb, 8) f32."""
    s = sc.astype(np.uint8)
    scale = np.empty(s.shape[:-1] + (8,), np.uint8)
    mins = np.empty_like(scale)
    scale[:, :4] = s[:, 0:4] & 63
    mins[:, :4] = s[:, 4:8] & 63
    scale[:, 4:] = (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)
    mins[:, 4:] = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return scale.astype(np.float32), mins.astype(np.float32)


def dequantize_blocks(qtype: QT, blocks: np.ndarray) -> np.ndarray:
    """blocks uint8 (nb, bytes_per_block) -> f32 (nb, values_per_block)."""
    nb = blocks.shape[0]
    if qtype == QT.F32:
        return blocks.view(np.float32).copy()
    if qtype == QT.F16:
        return blocks.view(np.float16).astype(np.float32)
    if qtype == QT.BF16:
        return (blocks.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    if qtype == QT.Q8_0:
        return _f16(blocks[:, 0:2])[:, None] * blocks[:, 2:].view(np.int8).astype(np.float32)
    if qtype == QT.Q4_0:
        return _f16(blocks[:, 0:2])[:, None] * (_nibbles(blocks[:, 2:]).astype(np.float32) - 8.0)
    if qtype == QT.Q4_1:
        d, m = _f16(blocks[:, 0:2])[:, None], _f16(blocks[:, 2:4])[:, None]
        return d * _nibbles(blocks[:, 4:]).astype(np.float32) + m
    if qtype == QT.Q5_0:
        return _f16(blocks[:, 0:2])[:, None] * (_q5_values(blocks[:, 2:6], blocks[:, 6:]).astype(np.float32) - 16.0)
    if qtype == QT.Q5_1:
        d, m = _f16(blocks[:, 0:2])[:, None], _f16(blocks[:, 2:4])[:, None]
        return d * _q5_values(blocks[:, 4:8], blocks[:, 8:]).astype(np.float32) + m
    if qtype == QT.Q5_K:
        d, dmin = _f16(blocks[:, 0:2])[:, None], _f16(blocks[:, 2:4])[:, None]
        sc, mn = _q4k_scales(blocks[:, 4:16])  # (nb, 8)
        qh = blocks[:, 16:48]  # (nb, 32): bit j of byte l = the high bit of value l of sub-block j
        qs = blocks[:, 48:].reshape(nb, 4, 32)
        lo = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(nb, 8, 32)
        hi = np.stack([(qh >> j) & 1 for j in range(8)], axis=1)  # (nb, 8, 32)
        q = (lo | (hi << 4)).astype(np.float32)
        return ((d * sc)[:, :, None] * q - (dmin * mn)[:, :, None]).reshape(nb, QK_K)
    if qtype == QT.Q4_K:
        d, dmin = _f16(blocks[:, 0:2])[:, None], _f16(blocks[:, 2:4])[:, None]
        sc, mn = _q4k_scales(blocks[:, 4:16])  # (nb, 8)
        qs = blocks[:, 16:].reshape(nb, 4, 32)  # 4 chunks of 64 values
        q = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(nb, 8, 32).astype(np.float32)  # sub-block j
        return ((d * sc)[:, :, None] * q - (dmin * mn)[:, :, None]).reshape(nb, QK_K)
    if qtype == QT.Q6_K:
        ql = blocks[:, 0:128].reshape(nb, 2, 64)  # two halves of 128 values
        qh = blocks[:, 128:192].reshape(nb, 2, 32)
        sc = blocks[:, 192:208].view(np.int8).astype(np.float32)  # (nb, 16)
        d = _f16(blocks[:, 208:210])[:, None]
        # within a half: l in 0..31 -> values l, l+32, l+64, l+96 take 4 low bits from ql[l], ql[l+32],
        # ql[l] >> 4, ql[l+32] >> 4 and 2 high bits from qh[l] bits 0-1, 2-3, 4-5, 6-7
        lo = np.stack([ql[:, :, :32] & 0x0F, ql[:, :, 32:] & 0x0F, ql[:, :, :32] >> 4, ql[:, :, 32:] >> 4], 2)
        hi = np.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=2)
        q = (lo | (hi << 4)).astype(np.float32) - 32.0  # (nb, 2, 4, 32)
        return (d * sc)[:, :, None].reshape(nb, 16, 1).repeat(16, axis=2).reshape(nb, QK_K) * q.reshape(nb, QK_K)
    block_info(qtype)  # raises for unsupported types
    raise AssertionError(qtype)


def dequantize_rows(qt: QTensor, start: int = 0, stop: int | None = None) -> np.ndarray:
    """Rows start..stop of qt as f32 (n_rows, cols): e.g. a few embedding rows without the whole table."""
    raw = _raw_rows(qt)[start:stop]
    bs, bb = block_info(qt.qtype, qt.name)
    vals = dequantize_blocks(qt.qtype, raw.reshape(-1, bb))
    return vals.reshape(raw.shape[0], qt.shape[-1])


def dequantize(qt: QTensor) -> np.ndarray:
    """The numpy reference: f32 (rows, cols) (1-D tensors: (n,)). Validates the byte size first."""
    validate(qt)
    out = dequantize_rows(qt)
    return out.reshape(qt.shape) if len(qt.shape) == 1 else out.reshape(-1, qt.shape[-1])
