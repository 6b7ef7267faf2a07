"""The 'q4k' layout (engine/backends/cpu/q4k.py): Q4_K blocks that keep the file's 6-bit scales, bit for bit the
outputs of the Q4_1 blocks Q4_K took before (kquant.q4k_as_q41 + fast's 'q4' kernels) in every form (decode,
multi-row, unpacked, generic, embedding), and where each byte lands."""
from __future__ import annotations

import os

os.environ.setdefault("NUMBA_NUM_THREADS", "2")

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from reference_forward import random_qtensor

from engine.backends.cpu import fast, kquant, q4k
from engine.backends.cpu.layout import K_BLK, K_HDR, K_MN, K_SC, SB4K, f2h
from engine.quant import QTensor, _q4k_scales


def _q41(qt):
    """The reference: the same tensor as Q4_1 blocks in fast's 'q4' layout."""
    raw = kquant.q4k_as_q41(np.asarray(qt.data).view(np.uint8).reshape(qt.shape[0], -1))
    return fast.repack(QTensor(qt.name, QT.Q4_1, tuple(qt.shape), raw))


def _tensor(rows, cols, seed, tiny=True, extreme=False):
    qt = random_qtensor(QT.Q4_K, rows, cols, np.random.default_rng(seed))
    raw = np.asarray(qt.data).view(np.uint8).reshape(rows, -1, 144)
    if tiny:  # super-block scales whose products with the 6-bit scales are f16 subnormals, of both signs
        raw[:3, :, 0:2] = np.frombuffer(np.float16(3e-6).tobytes(), np.uint8)
        raw[3:5, :, 2:4] = np.frombuffer(np.float16(-2e-7).tobytes(), np.uint8)
    if extreme:  # every nibble 15, every scale and min 63
        raw[..., 4:144] = 0xFF
    return qt


def _quantized(t_n, cols, seed, extreme=False):
    x = np.random.default_rng(seed).standard_normal((t_n, cols)).astype(np.float32)
    if extreme:
        x = np.sign(x).astype(np.float32)
    nb = cols // 32
    qa, sa, xs = (np.zeros((t_n, cols), np.int8), np.zeros((t_n, nb), np.float32),
                  np.zeros((t_n, fast.XS * nb), np.float32))
    fast.quantize_rows(qa, sa, xs, x)
    return x, qa, sa, xs


def test_f2h_rounds_as_numpy():
    """layout.f2h (the generic kernels' f16 rounding) gives numpy's bits: normals, subnormals, ties, the edges of
    the range, inf and NaN."""
    rng = np.random.default_rng(0)
    x = np.concatenate([
        (rng.standard_normal(20000) * np.exp2(rng.integers(-30, 18, 20000))).astype(np.float32),
        rng.integers(0, 1 << 32, 20000, dtype=np.uint64).astype(np.uint32).view(np.float32),  # any bit pattern
        np.float16(rng.standard_normal(4000)).astype(np.float32) * np.float32(1 + 2 ** -11),  # ties
        np.array([0.0, -0.0, 65504, 65519.99, 65520, -65520, 2 ** -24, 2 ** -25, 3 * 2 ** -26, 6.1e-5, np.inf,
                  -np.inf], np.float32)])
    got = np.array([f2h(v) for v in x], np.uint16)
    with np.errstate(over="ignore", invalid="ignore"):
        want = x.astype(np.float16).view(np.uint16)
    nan = np.isnan(x)
    np.testing.assert_array_equal(got[~nan], want[~nan])
    assert np.isnan(got[nan].view(np.float16)).all()


def test_layout_bytes():
    """Per super-block the rows' d and dmin bits as the file has them, then per block the nibbles where the 'q4'
    layout has them and the rows' 6-bit scales and mins."""
    rows, cols = 45, 512
    qt = _tensor(rows, cols, 1)
    w, ref = fast.prepare_weight(qt), _q41(qt)
    assert w.kind == "q4k" and w.blocks.shape == (2, cols // 256, SB4K)
    raw = np.asarray(qt.data).view(np.uint8).reshape(rows, -1, 144)
    sc, mn = (a.reshape(rows, -1) for a in _q4k_scales(raw[..., 4:16].reshape(-1, 12)))
    for r in range(rows):
        g, rr = divmod(r, 32)
        for s in range(cols // 256):
            sb = w.blocks[g, s]
            assert bytes(sb[2 * rr:2 * rr + 2]) == bytes(raw[r, s, 0:2])
            assert bytes(sb[64 + 2 * rr:64 + 2 * rr + 2]) == bytes(raw[r, s, 2:4])
            for j in range(8):
                at = K_HDR + j * K_BLK
                assert sb[at + K_SC + rr] == sc[r, 8 * s + j] and sb[at + K_MN + rr] == mn[r, 8 * s + j]
    for s in range(cols // 256):  # the nibbles, all rows (padding rows zero in both)
        for j in range(8):
            at = K_HDR + j * K_BLK
            np.testing.assert_array_equal(w.blocks[:, s, at:at + 512], ref.blocks[:, 8 * s + j, :512])
    assert w.d.shape == (2, cols // 256, 32) and w.qs is None


@pytest.mark.parametrize("rows", [45, 96])  # 45: a padded last row group
@pytest.mark.parametrize("extreme", [False, True])
@pytest.mark.parametrize("t_n", [1, 2, 3, 5, 8, 20])
def test_matmul_bitwise_as_q41(rows, extreme, t_n):
    """Every form gives the bits of the Q4_1 blocks' kernels: the public matmul (decode form at T = 1, the
    multi-row form above), the unpacked form, the generic kernel; and a row of a T-row call equals a one-row
    call."""
    cols = 512
    qt = _tensor(rows, cols, rows + t_n, extreme=extreme)
    w, ref = fast.prepare_weight(qt), _q41(qt)
    x, qa, sa, xs = _quantized(t_n, cols, t_n, extreme)
    got, want = (np.full((t_n, rows), np.nan, np.float32) for _ in range(2))
    fast.matmul(got, x, w, fast.new_scratch(t_n, cols))
    fast.matmul(want, x, ref, fast.new_scratch(t_n, cols))
    assert np.isfinite(want).all() and np.abs(want).max() > 0
    np.testing.assert_array_equal(got, want)
    for form in (q4k.group_generic, q4k.group_unpacked):
        other = np.full((t_n, rows), np.nan, np.float32)
        for g in range(w.blocks.shape[0]):
            form(other, qa, sa, xs, w.blocks, g)
        np.testing.assert_array_equal(other, want)
    one = np.full((1, rows), np.nan, np.float32)
    for t in range(t_n):
        fast.matmul(one, x[t:t + 1], w, fast.new_scratch(1, cols))
        np.testing.assert_array_equal(one[0], got[t])


def test_embed_as_q41():
    qt = _tensor(70, 512, 3)
    w, ref = fast.prepare_weight(qt), _q41(qt)
    tokens = np.arange(70, dtype=np.int32)
    got, want = np.zeros((70, 512), np.float32), np.zeros((70, 512), np.float32)
    fast.embed(got, w, tokens)
    fast.embed(want, ref, tokens)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("threads", [1, 2])
def test_parts_as_one(threads):
    """A role of Q4_K layers in prepare_layers' parts computes what the weight alone does (mm_parts, mm_part)."""
    rng = np.random.default_rng(threads)
    roles = {"a": [random_qtensor(QT.Q4_K, 128, 256, rng, name=f"blk.{i}.a") for i in range(2)]}
    ws = fast.prepare_layers(roles, threads=threads)
    x, qa, sa, xs = _quantized(3, 256, 5)
    for qt in roles["a"]:
        w, one = ws[qt.name], fast.prepare_weight(qt)
        assert w.blocks.ndim == 4 and w.blocks.shape[0] == threads
        a, b, c = (np.full((3, 128), np.nan, np.float32) for _ in range(3))
        fast.matmul(a, x, w, fast.new_scratch(3, 256))
        fast.matmul(b, x, one, fast.new_scratch(3, 256))
        q4k.mm_part(0, 4, c, qa, sa, xs, w.blocks)
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(c, b)
